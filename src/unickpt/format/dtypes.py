"""Names of torch dtypes in the metadata, and raw byte views of tensors."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CheckpointCorruptError, CheckpointError


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(
            f"the metadata names dtype {name!r}, which this torch ({torch.__version__}) does not "
            "have; load with the torch version that saved it, or a newer one."
        )
    return dtype


def known_dtype_names() -> tuple[str, ...]:
    """The names of this torch's dtypes, as the metadata writes them."""
    found = {dtype_name(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}
    return tuple(sorted(found))


def check_dtype_name(name: str, key: str, source: str) -> str:
    """``name`` where it names a dtype of this torch; damage otherwise (a reader would
    otherwise ask for a state of that dtype)."""
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise CheckpointCorruptError(
            f"{source}: the metadata names dtype {name!r} for key '{key}'; known: "
            f"{', '.join(known_dtype_names())}; the file is damaged or from a newer unickpt "
            "(or torch). Load an earlier checkpoint, or upgrade."
        )
    return name


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    if not t.is_contiguous():
        raise AssertionError("byte_view needs a contiguous tensor")
    flat = t.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    try:
        return flat.view(torch.uint8)
    except RuntimeError as e:
        raise CheckpointError(
            f"tensors of dtype {t.dtype} cannot be viewed as bytes ({e}); unickpt stores dtypes "
            "whose elements are whole bytes. Convert the tensor before saving."
        ) from e


def buffer_of(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU uint8 tensor's bytes (no copy)."""
    return memoryview(t.numpy())  # type: ignore[arg-type]


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a numpy uint8 array (no copy)."""
    return byte_view(t).numpy()
