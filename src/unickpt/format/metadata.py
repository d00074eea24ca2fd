"""The metadata of a checkpoint: what each tensor is, where its chunks lie, their checksums.

Version 2 (version 1 is read as well). See docs/format.md for the byte-level description. On
disk the global metadata holds tensors, values and files; each writing rank's chunks live in
that rank's index file, so the coordinator's work per save grows with tensors plus ranks, never
with their product. Everything here is plain data: frozen dataclasses, encoded as JSON by
:mod:`unickpt.format.codec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..layouts.boxes import Box

FORMAT_NAME = "unickpt"
FORMAT_VERSION = 2
COMMIT_FILE = "COMMIT"
CHECKSUM_ALGORITHM = "xxh3_64"


@dataclass(frozen=True)
class ChunkMeta:
    """One stored box of a tensor: where it lies in the global tensor and in which file.

    The box's elements are stored row-major at ``[byte_offset, byte_offset + nbytes)`` of
    ``files[file]``. ``checksums[i]`` covers bytes ``[i * segment_bytes, (i + 1) *
    segment_bytes)`` of the chunk (the last segment may be shorter).
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: int
    byte_offset: int
    nbytes: int
    checksums: tuple[str, ...] = ()

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.lengths)


@dataclass(frozen=True)
class TensorMeta:
    """A global tensor: dtype, shape, the layout it was saved from, and its stored chunks."""

    dtype: str
    shape: tuple[int, ...]
    layout: str
    chunks: tuple[ChunkMeta, ...]


@dataclass(frozen=True)
class FileRef:
    """A data file and the index file that lists its chunks (with their checksums)."""

    data: str
    nbytes: int
    index: str
    index_nbytes: int
    index_checksum: str


@dataclass(frozen=True)
class Metadata:
    """Everything a reader needs besides the raw bytes of the data files."""

    world_size: int
    files: tuple[str, ...]
    tensors: dict[str, TensorMeta]
    objects: dict[str, Any]
    per_rank: dict[str, tuple[Any, ...]]
    segment_bytes: int
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    version: int = FORMAT_VERSION
    created_unix_s: float = 0.0
    producer: dict[str, str] = field(default_factory=dict)
    pickled_keys: tuple[str, ...] = ()
    file_refs: tuple[FileRef, ...] = ()
    references: tuple[str, ...] = ()
    """Step folders (beside this checkpoint's) whose data files hold some of its chunks; the
    chunks that lie there name those files in ``files`` as ``../<step folder>/<data file>``
    (see :mod:`unickpt.format.references`). Empty for a self-contained checkpoint."""

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for t in self.tensors.values() for c in t.chunks)


@dataclass(frozen=True)
class CommitRecord:
    """The commit marker: names the metadata file and pins its size and checksum.

    Written last and atomically; a folder without it holds no checkpoint.
    """

    metadata_file: str
    metadata_nbytes: int
    metadata_checksum: str
    save_id: str
    version: int = FORMAT_VERSION
