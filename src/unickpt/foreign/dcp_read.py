"""A ``torch.distributed.checkpoint`` (DCP) folder as unickpt metadata, so a load reads it
online and reshards it like a unickpt checkpoint.

DCP's pickled ``.metadata`` is read as plain data and what DCP metadata holds
(:mod:`.dcp_pickles`, unless pickle is allowed), and every byte range it states is checked
against the folder's files before anything is read or allocated; it gives each tensor's chunks
(offsets and sizes) and, per chunk, a byte range of a ``__N_M.distcp`` file. DCP stores each
chunk there as a ``torch.save`` archive (or as raw bytes): the archive's zip directory and its
small pickle, read from the start and end of the range and read as a tensor's pickle, give
where the chunk's raw row-major bytes begin. Each rank then reads, of those, only
the bytes of what it holds. Non-tensor entries (``torch.save`` bytes) are read with
``torch.load(weights_only=True)``, once their pickle is found to be plain data and tensors (no
constructor given a size), and must be values unickpt stores without pickle. DCP files
carry no checksums: the load report names them as unverified.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
from typing import Any

import torch

from ..errors import CheckpointCorruptError, CheckpointError, UnsafeObjectError
from ..format.dtypes import dtype_name, itemsize
from ..format.metadata import ChunkMeta, Metadata, TensorMeta
from ..format.values import encode_value
from ..storage.base import Storage
from .common import FORMAT_KEY, SEGMENT_BYTES
from .dcp_checks import METADATA_FILE, check_storage, storage_info
from .dcp_pickles import check_value_archive, load_dcp_metadata, load_tensor_pickle

DCP = "dcp"
_EDGE_BYTES = 4096
"""Bytes read from each end of a chunk's archive: its first entries and its zip directory."""


def read_dcp(storage: Storage, allow_pickle: bool = False) -> Metadata:
    """The metadata of the DCP folder ``storage``, every chunk at its raw bytes."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    dcp_meta = _read_metadata(storage, allow_pickle)
    check_storage(dcp_meta, storage.size, storage.location)
    data = dcp_meta.storage_data or {}
    files = sorted({info.relative_path for info in data.values()})
    number = {f: i for i, f in enumerate(files)}
    tensors: dict[str, TensorMeta] = {}
    objects: dict[str, Any] = {}
    for fqn, md in dcp_meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            chunks = []
            for i, c in enumerate(md.chunks):
                info = _info(data, MetadataIndex(fqn, torch.Size(c.offsets), i), storage)
                where = _raw_range(storage, fqn, info, tuple(c.sizes), md.properties.dtype)
                chunks.append(
                    ChunkMeta(tuple(c.offsets), tuple(c.sizes), number[info.relative_path], *where)
                )
            shape = tuple(md.size)
            tensors[fqn] = TensorMeta(dtype_name(md.properties.dtype), shape, "dcp", tuple(chunks))
            _check_tiled(fqn, shape, chunks)
        elif isinstance(md, BytesStorageMetadata):
            info = _info(data, MetadataIndex(fqn), storage)
            objects[fqn] = _read_value(storage, fqn, info, allow_pickle)
    return Metadata(
        world_size=1,
        files=tuple(files),
        tensors=tensors,
        objects=objects,
        per_rank={},
        segment_bytes=SEGMENT_BYTES,
        producer={FORMAT_KEY: DCP},
    )


def _read_metadata(storage: Storage, allow_pickle: bool) -> Any:
    where = f"{storage.location}/{METADATA_FILE}"
    raw = storage.read_bytes(METADATA_FILE)
    if raw is None:
        raise CheckpointCorruptError(f"{where} is missing; the DCP checkpoint is incomplete.")
    try:
        return pickle.loads(raw) if allow_pickle else load_dcp_metadata(raw, where)
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointCorruptError(f"{where} could not be read ({e}); it is damaged.") from e


def _info(data: dict[Any, Any], key: Any, storage: Storage) -> Any:
    info = storage_info(data, key, f"{storage.location}/{METADATA_FILE}")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(
            f"'{getattr(key, 'fqn', key)}' is stored with DCP extensions "
            f"({', '.join(info.transform_descriptors)}), which unickpt does not decode; load it "
            "with torch.distributed.checkpoint.load, or save it without extensions."
        )
    return info


def _raw_range(
    storage: Storage, fqn: str, info: Any, sizes: tuple[int, ...], dtype: torch.dtype
) -> tuple[int, int]:
    """``(byte offset, bytes)`` of a chunk's raw row-major bytes in its file."""
    nbytes = math.prod(sizes) * itemsize(dtype)
    where = f"{storage.location}/{info.relative_path}"
    if info.length == nbytes:  # raw bytes (DCP's non-torch.save serialization)
        return info.offset, nbytes
    archive = _Window(storage, info.relative_path, info.offset, info.length)
    start, stored = _archive_data(archive, where, fqn, sizes, dtype)
    if stored < nbytes or start + nbytes > info.length:
        raise CheckpointCorruptError(
            f"{where}: the archive of '{fqn}' at {info.offset} holds {stored} bytes; its chunk "
            f"{list(sizes)} of {dtype} needs {nbytes}. The checkpoint is damaged."
        )
    return info.offset + start, nbytes


def _archive_data(
    archive: _Window, where: str, fqn: str, sizes: tuple[int, ...], dtype: torch.dtype
) -> tuple[int, int]:
    """Where, in a ``torch.save`` archive, the chunk's raw bytes start, and how many bytes its
    storage holds from there."""
    try:
        with zipfile.ZipFile(archive) as z:
            pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
            prefix = pkl.rsplit("/", 1)[0]
            order = next((n for n in z.namelist() if n.endswith("/byteorder")), None)
            if order is not None and z.read(order) != b"little":
                raise CheckpointError(f"{where}: '{fqn}' is stored big-endian; load it with DCP.")
            tensor = load_tensor_pickle(z.read(pkl), where)
            info = z.getinfo(f"{prefix}/data/{tensor.key}")
    except (zipfile.BadZipFile, StopIteration, KeyError, pickle.UnpicklingError, EOFError) as e:
        raise CheckpointCorruptError(
            f"{where}: '{fqn}' is not stored as a torch.save archive DCP writes ({e}); the "
            "checkpoint is damaged."
        ) from e
    contiguous = tuple(math.prod(sizes[d + 1 :]) for d in range(len(sizes)))
    same = tuple(tensor.size) == sizes and all(
        s == c for s, c, n in zip(tensor.stride, contiguous, sizes) if n > 1
    )
    if info.compress_type != zipfile.ZIP_STORED or not same:
        raise CheckpointError(
            f"{where}: '{fqn}' is stored compressed or not row-major (size "
            f"{list(tensor.size)}, strides {list(tensor.stride)}); unickpt reads only raw "
            "row-major chunks. Load it with torch.distributed.checkpoint.load."
        )
    skip = tensor.offset * itemsize(dtype)
    return archive.header(info.header_offset) + skip, info.file_size - skip


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of a file as a seekable file, its first and last
    :data:`_EDGE_BYTES` read once (a zip's first entries and its directory); other reads go to
    the storage."""

    def __init__(self, storage: Storage, name: str, offset: int, length: int) -> None:
        super().__init__()
        self.storage, self.name, self.offset, self.length = storage, name, offset, length
        self.pos = 0
        edge = min(_EDGE_BYTES, length)
        self.head = self._read(0, edge)
        self.tail_start = length - edge
        self.tail = self._read(self.tail_start, edge)

    def _read(self, start: int, n: int) -> bytes:
        out = bytearray(n)
        if n:
            self.storage.read_into(self.name, self.offset + start, memoryview(out))
        return bytes(out)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, out: Any) -> int:
        n = max(0, min(len(out), self.length - self.pos))
        lo, hi = self.pos, self.pos + n
        if hi <= len(self.head):
            chunk = self.head[lo:hi]
        elif lo >= self.tail_start:
            chunk = self.tail[lo - self.tail_start : hi - self.tail_start]
        else:
            chunk = self._read(lo, n)
        out[:n] = chunk
        self.pos = hi
        return n

    def header(self, at: int) -> int:
        """The offset of the data of the zip entry whose local header is at ``at``."""
        self.seek(at)
        fixed = self.read(30)
        if len(fixed) != 30 or fixed[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile("no local file header where the directory points")
        name_len, extra_len = struct.unpack("<HH", fixed[26:30])
        return at + 30 + name_len + extra_len


def _check_tiled(key: str, shape: tuple[int, ...], chunks: list[ChunkMeta]) -> None:
    from ..layouts.coverage import tiling_fault
    from ..planning.load_plan import not_tiled

    fault = tiling_fault(shape, [c.box for c in chunks])
    if fault is not None:
        raise not_tiled(key, shape, fault)


def _read_value(storage: Storage, fqn: str, info: Any, allow_pickle: bool) -> Any:
    """The value of entry ``fqn``, its range within its file (:func:`check_storage`)."""
    raw = bytearray(info.length)
    storage.read_into(info.relative_path, info.offset, memoryview(raw))
    if not allow_pickle:
        check_value_archive(raw, f"{storage.location}/{info.relative_path} ('{fqn}')")
    try:
        value = torch.load(io.BytesIO(raw), weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        raise UnsafeObjectError(
            f"'{fqn}' of the DCP checkpoint is an object torch.load(weights_only=True) "
            "refuses; if you trust the checkpoint, pass allow_pickle=True."
        ) from e
    except (RuntimeError, EOFError, ValueError) as e:
        raise CheckpointCorruptError(
            f"'{fqn}' of the DCP checkpoint ({info.length} bytes at {info.offset} of "
            f"{storage.location}/{info.relative_path}) is not a torch.save archive torch.load "
            f"reads ({str(e).splitlines()[0]}); the checkpoint is damaged."
        ) from e
    return encode_value(value, fqn, allow_pickle)
