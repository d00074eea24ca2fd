"""Names of torch dtypes in the metadata, and raw byte views of tensors.

Reading a checkpoint's metadata needs the names and sizes of its dtypes only: they are known
here without importing torch (``unickpt inspect`` and ``verify`` import none). Functions that
take or give torch objects import torch when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import CheckpointCorruptError, CheckpointError

if TYPE_CHECKING:
    import numpy as np
    import torch

# Bytes per element of torch's dtypes, by the names the metadata writes (torch 2.13's).
ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    **{f"{sign}int{bits}": 1 for sign in ("", "u") for bits in range(1, 8)},
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(
            f"the metadata names dtype {name!r}, which this torch ({torch.__version__}) does not "
            "have; load with the torch version that saved it, or a newer one."
        )
    return dtype


def itemsize_of(name: str) -> int:
    """Bytes per element of the dtype the metadata names ``name`` (torch imported only for a
    name this module does not know)."""
    size = ITEMSIZES.get(name)
    return size if size is not None else itemsize(dtype_from_name(name))


def known_dtype_names() -> tuple[str, ...]:
    """The names of this torch's dtypes, as the metadata writes them."""
    import torch

    found = {dtype_name(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}
    return tuple(sorted(found))


def check_dtype_name(name: str, key: str, source: str) -> str:
    """``name`` where it names a dtype of torch; damage otherwise (a reader would otherwise
    ask for a state of that dtype)."""
    if name in ITEMSIZES:
        return name
    import torch

    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise CheckpointCorruptError(
            f"{source}: the metadata names dtype {name!r} for key '{key}'; known: "
            f"{', '.join(known_dtype_names())}; the file is damaged or from a newer unickpt "
            "(or torch). Load an earlier checkpoint, or upgrade."
        )
    return name


def itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    import torch

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
