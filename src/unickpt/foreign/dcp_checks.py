"""DCP metadata checked against the folder it describes, before anything it states is read or
allocated.

DCP's ``.metadata`` names, per entry, a data file and a byte range in it, and per tensor its
size and chunks. All of that is what a file someone else wrote says: a data file named by a
path (absolute, ``../``) reads outside the checkpoint, and a length or a size is memory a
reader would allocate. :func:`check_storage` refuses metadata whose entries are not ranges of
the folder's own files, apart from each other, or whose tensors are not the sum of their
chunks, each within its range: the bytes a reader then allocates are bytes the files hold. The
online reader (:mod:`.dcp_read`) and ``convert --from dcp`` (:mod:`unickpt.tools.from_dcp`,
through torch's reader) both run it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CheckpointCorruptError

METADATA_FILE = ".metadata"


def check_storage(meta: Any, size_of: Callable[[str], int | None], where: str) -> None:
    """Refuse DCP metadata ``meta`` of the folder ``where`` (``size_of(name)``: the size of a
    file of it, None when missing) unless every entry lies in a file of the folder, apart from
    the others, and every tensor is tiled by chunks as large as their entries allow."""
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    source = f"{where}/{METADATA_FILE}"
    if not isinstance(meta, Metadata):
        raise CheckpointCorruptError(
            f"{source} holds a {type(meta).__name__}, expected DCP's Metadata; it is damaged."
        )
    data = meta.storage_data or {}
    entries = meta.state_dict_metadata
    if not isinstance(data, dict) or not isinstance(entries, dict):
        raise CheckpointCorruptError(f"{source} has no table of entries; it is damaged.")
    _check_ranges(data, size_of, where)
    for fqn, md in entries.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        shape = _dims(md.size, fqn, "size", source)
        dtype = getattr(md.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointCorruptError(f"{source}: '{fqn}' has no dtype; it is damaged.")
        covered = 0
        for i, c in enumerate(md.chunks):
            offsets = _dims(c.offsets, fqn, "chunk offsets", source)
            sizes = _dims(c.sizes, fqn, "chunk sizes", source)
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise CheckpointCorruptError(
                    f"{source}: a chunk of '{fqn}' has {len(sizes)} dimensions, the tensor "
                    f"{len(shape)}; the checkpoint is damaged."
                )
            info = storage_info(data, MetadataIndex(fqn, torch.Size(offsets), i), source)
            nbytes = math.prod(sizes) * dtype.itemsize
            if nbytes > info.length:
                raise CheckpointCorruptError(
                    f"{source}: the chunk of '{fqn}' at {list(offsets)} ({list(sizes)} of "
                    f"{dtype}, {nbytes} bytes) is given {info.length} bytes of "
                    f"{info.relative_path}; the checkpoint is damaged."
                )
            covered += math.prod(sizes)
        if covered != math.prod(shape):
            raise CheckpointCorruptError(
                f"{source}: the chunks of '{fqn}' hold {covered} elements, the tensor "
                f"{list(shape)} {math.prod(shape)}; the checkpoint is damaged."
            )


def _check_ranges(data: dict[Any, Any], size_of: Callable[[str], int | None], where: str) -> None:
    """Every entry's range lies in its file, and no two entries' ranges overlap."""
    source = f"{where}/{METADATA_FILE}"
    sizes: dict[str, int | None] = {}
    spans = []
    for key, info in data.items():
        fqn = getattr(key, "fqn", key)
        check_info(info, fqn, source)
        name = info.relative_path
        if name not in sizes:
            sizes[name] = size_of(name)
        size, end = sizes[name], info.offset + info.length
        if size is None or end > size:
            raise CheckpointCorruptError(
                f"{where}/{name} has {size} bytes but the DCP metadata places '{fqn}' at bytes "
                f"[{info.offset}, {end}); the checkpoint is incomplete or damaged."
            )
        spans.append((name, info.offset, end, str(fqn)))
    spans.sort()
    for (name, _, end, fqn), (other, start, _, second) in itertools.pairwise(spans):
        if name == other and start < end:
            raise CheckpointCorruptError(
                f"{source} places '{fqn}' and '{second}' in overlapping bytes of {name}; the "
                "checkpoint is damaged."
            )


def check_info(info: Any, fqn: Any, source: str) -> None:
    """An entry's data file is a file of the folder (no path), its range two integers."""
    if not all(hasattr(info, a) for a in ("relative_path", "offset", "length")):
        raise CheckpointCorruptError(
            f"{source} has no file and byte range for {fqn!r}; the DCP checkpoint is damaged "
            "or was not written by DCP's file system writer."
        )
    name = info.relative_path
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name[0] == ".":
        raise CheckpointCorruptError(
            f"{source} names data file {name!r} for {fqn!r}; expected a file of the "
            "checkpoint's folder (a name, not a path). The checkpoint is damaged."
        )
    if not all(type(n) is int and n >= 0 for n in (info.offset, info.length)):
        raise CheckpointCorruptError(
            f"{source} places {fqn!r} at offset {info.offset!r}, length {info.length!r}; "
            "expected two non-negative integers. The checkpoint is damaged."
        )


def storage_info(data: dict[Any, Any], key: Any, source: str) -> Any:
    """The storage entry of ``key`` (a ``MetadataIndex``), checked."""
    info = data.get(key)
    check_info(info, getattr(key, "fqn", key), source)
    return info


def _dims(value: Any, fqn: str, what: str, source: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(n) is int and n >= 0 for n in value):
        raise CheckpointCorruptError(
            f"{source}: the {what} of '{fqn}' are {str(value)[:80]}, expected non-negative "
            "integers; the checkpoint is damaged."
        )
    return tuple(value)
