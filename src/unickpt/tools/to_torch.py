"""Export a checkpoint to one ``torch.save`` file that ``torch.load(weights_only=True)`` reads.

The file is written in two passes so that memory stays bounded: ``torch.save`` first writes
the structure with every tensor's storage left empty (``torch.serialization.skip_data`` with
fake tensors), then each tensor's bytes are streamed from the checkpoint into the place
``torch.load`` reads them from. The result is an ordinary ``torch.save`` file.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..engine.tensor_reader import CheckpointReader
from ..format.dtypes import dtype_from_name
from ..storage.base import Storage
from .blocks import DEFAULT_BLOCK_BYTES, raw_bytes, stream_tensor
from .output import atomic_file, check_distinct
from .progress import ProgressFn
from .reports import ConvertReport
from .selection import nest_top_level, select_keys
from .values import decode_values, warn_left_out

log = logging.getLogger(__name__)

ObjPath = tuple[Any, ...]


@dataclass(frozen=True)
class _Fill:
    """Bytes to put into the storage of the tensor at ``path``: a checkpoint key or a tensor."""

    path: ObjPath
    key: str | None
    tensor: torch.Tensor | None
    nbytes: int


def export_torch(
    src: str | os.PathLike[str] | Storage,
    dst: str | os.PathLike[str],
    *,
    only: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: ProgressFn | None = None,
) -> ConvertReport:
    """Write checkpoint ``src`` as a ``torch.save`` file of a nested dict.

    Keys are grouped by their first component (``{"model": {"layers.0.weight": ...},
    "step": 7}``); with ``only="model"`` the file holds that subtree as a flat dict, ready for
    ``model.load_state_dict(torch.load(dst, weights_only=True))``. Values that
    ``weights_only=True`` could not read are left out with a warning.

    ``src`` is a checkpoint at any path or URL (or a Storage); ``verify=False`` reads it without
    checking its checksums. ``dst`` is a local path.

    >>> export_torch("ckpt/step-100", "model.pt", only="model")  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    dst_path = Path(dst)
    check_distinct(src, dst_path)
    with CheckpointReader(src, verify=verify) as reader:
        selection = select_keys(reader.metadata, only)
        values, left_out = decode_values(reader, selection)
        values = _weights_only_values(values, selection.values, left_out)
        warn_left_out(left_out, "torch export")
        obj, fills = _skeleton(
            reader, selection.tensors, selection.aliases, values, nested=not only
        )
        total = sum(f.nbytes for f in fills if f.key is not None)
        with atomic_file(dst_path, overwrite) as tmp:
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save(obj, tmp)
            _fill_storages(tmp, fills, reader, block_bytes, progress, total)
    return ConvertReport(
        reader.storage.location,
        str(dst_path),
        "torch",
        (str(dst_path),),
        len(selection.tensors),
        len(values),
        total,
        tuple(left_out),
        time.perf_counter() - t0,
    )


def _skeleton(
    reader: CheckpointReader,
    tensors: dict[str, str],
    aliases: dict[str, str],
    values: dict[str, Any],
    nested: bool,
) -> tuple[dict[str, Any], list[_Fill]]:
    """The object to save, holding fake tensors, and where each tensor's bytes come from.
    A tied key holds the very tensor it is tied to (``torch.save`` stores it once)."""
    fills: list[_Fill] = []
    flat = _fake_tensors(reader, tensors, fills)
    flat.update({name: flat[target] for name, target in aliases.items()})
    flat.update({name: _fake_nested(v, (name,), fills) for name, v in values.items()})
    flat = dict(sorted(flat.items()))
    if not nested:
        return flat, fills
    return nest_top_level(flat), [replace(f, path=_nested_path(f.path)) for f in fills]


def _nested_path(path: ObjPath) -> ObjPath:
    head, dot, rest = str(path[0]).partition(".")
    return (head, rest, *path[1:]) if dot else path


def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _fake_tensors(
    reader: CheckpointReader, tensors: dict[str, str], fills: list[_Fill]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with _fake_mode():
        for name, key in tensors.items():
            meta = reader.metadata.tensor(key)
            assert meta is not None
            t = torch.empty(meta.value_shape, dtype=dtype_from_name(meta.value_dtype))
            out[name] = t
            fills.append(_Fill((name,), key, None, t.numel() * t.element_size()))
    return out


def _fake_nested(value: Any, path: ObjPath, fills: list[_Fill]) -> Any:
    """``value`` with each tensor inside it replaced by a fake one (its bytes go to ``fills``)."""
    if isinstance(value, torch.Tensor):
        real = value.detach().contiguous()
        with _fake_mode():
            fake = torch.empty(real.shape, dtype=real.dtype)
        fills.append(_Fill(path, None, real, real.numel() * real.element_size()))
        return fake
    if isinstance(value, dict):
        return {k: _fake_nested(v, (*path, k), fills) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_fake_nested(v, (*path, i), fills) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def _weights_only_values(
    values: dict[str, Any], keys: dict[str, str], left_out: list[str]
) -> dict[str, Any]:
    """The values ``torch.load(weights_only=True)`` reads back; the others go to ``left_out``."""
    kept = {}
    for name, value in values.items():
        buf = io.BytesIO()
        try:
            torch.save(value, buf)
            buf.seek(0)
            torch.load(buf, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, TypeError, AttributeError) as e:
            left_out.append(f"{keys[name]}: torch.load(weights_only=True) cannot read it ({e})")
            continue
        kept[name] = value
    return kept


def _fill_storages(
    path: Path,
    fills: list[_Fill],
    reader: CheckpointReader,
    block_bytes: int,
    progress: ProgressFn | None,
    total: int,
) -> None:
    offsets = _storage_offsets(path, fills)
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    with open(path, "r+b") as f:
        for fill, offset in zip(fills, offsets):
            f.seek(offset)
            if fill.tensor is not None:
                f.write(raw_bytes(fill.tensor))
            else:
                assert fill.key is not None
                stream_tensor(reader, fill.key, f.write, block_bytes, advance)


def _storage_offsets(path: Path, fills: list[_Fill]) -> list[int]:
    """Where in the file ``torch.load`` reads each tensor's storage from."""
    skeleton = torch.load(path, map_location="meta", weights_only=True)
    offsets = []
    for fill in fills:
        node = skeleton
        for part in fill.path:
            node = node[part]
        offset = node.untyped_storage()._checkpoint_offset
        if offset is None:
            raise AssertionError(f"no storage offset for {fill.path}")
        offsets.append(int(offset))
    return offsets
