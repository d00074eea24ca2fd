"""The metadata of a checkpoint: what each tensor is, where its chunks lie, their checksums.

Version 3 (versions 1 and 2 are read too; a checkpoint saved without compression is written
as version 2, so the previous release reads it). See docs/format.md for the byte-level
description. On disk
the global metadata holds tensors, values and files; each writing rank's chunks live in that
rank's index file, so the coordinator's work per save grows with tensors plus ranks, never with
their product. Everything here is plain data: frozen dataclasses, encoded as JSON by
:mod:`unickpt.format.codec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..layouts.boxes import Box
from .chunk_map import ChunkMap

FORMAT_NAME = "unickpt"
FORMAT_VERSION = 3
"""The newest version this unickpt reads and writes. Version 2 added ``aliases`` (tied
weights), ``{"$absent": true}`` in ``per_rank``, ``references`` (incremental checkpoints) and
tensor ``encoding`` (quantized tables); version 3 added compressed chunks
(:class:`Compression`)."""
PLAIN_FORMAT_VERSION = 2
"""The version of a checkpoint without compressed chunks (saved with ``compress=False``)."""
COMPRESSION_CODEC = "zstd-bytegroup"
COMMIT_FILE = "COMMIT"
CHECKSUM_ALGORITHM = "xxh3_64"
PER_RANK_ABSENT: dict[str, Any] = {"$absent": True}
"""The entry of a ``per_rank`` list for a rank that held no value under that key."""


def is_absent(encoded: Any) -> bool:
    return encoded == PER_RANK_ABSENT


@dataclass(frozen=True)
class Compression:
    """How a compressed chunk is stored: segment ``i`` (``segment_bytes`` raw bytes, the last
    possibly shorter) takes ``stored[i]`` bytes, the segments one after the other. A segment
    whose stored size equals its raw size is stored raw; any other is one zstd frame of its
    bytes grouped by ``width`` (byte 0 of every element, then byte 1, ...). See docs/format.md.
    """

    codec: str
    width: int
    stored: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.stored)


@dataclass(frozen=True)
class ChunkMeta:
    """One stored box of a tensor: where it lies in the global tensor and in which file.

    The box's elements are stored row-major at ``[byte_offset, byte_offset + nbytes)`` of
    ``files[file]``. ``checksums[i]`` covers bytes ``[i * segment_bytes, (i + 1) *
    segment_bytes)`` of the chunk (the last segment may be shorter).

    A compressed chunk (``compression`` set, version 3) keeps ``nbytes`` raw bytes in
    ``compression.nbytes`` stored bytes at ``byte_offset``; ``checksums[i]`` then covers the
    stored bytes of segment ``i``.
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: int
    byte_offset: int
    nbytes: int
    checksums: tuple[str, ...] = ()
    compression: Compression | None = None

    @property
    def stored_nbytes(self) -> int:
        """The bytes the chunk takes in its file."""
        return self.nbytes if self.compression is None else self.compression.nbytes

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.lengths)


@dataclass(frozen=True)
class EncodingError:
    """What an encoding changed in the values: the largest absolute difference, the root mean
    square of the differences, and that relative to the root mean square of the values."""

    max_abs: float
    rms: float
    rms_relative: float


ROWWISE_AFFINE = "rowwise-affine"
ENCODING_BITS = (4, 8)
ROWWISE_HEADER_BYTES = 8


def rowwise_stored_width(columns: int, bits: int) -> int:
    """Bytes of one stored row of a ``rowwise-affine`` table: its float32 scale and minimum,
    then one ``bits``-bit code per column (two per byte at 4 bits)."""
    return ROWWISE_HEADER_BYTES + (columns if bits == 8 else (columns + 1) // 2)


@dataclass(frozen=True)
class Encoding:
    """How a tensor's stored bytes encode its values (the stored tensor is ``TensorMeta.dtype``
    and ``shape``; readers decode it back to ``dtype`` and ``shape`` here).

    ``rowwise-affine``: each stored row is a ``scale_dtype`` scale and minimum followed by one
    ``bits``-bit code per column; a value is ``minimum + code * scale``.
    """

    name: str
    bits: int
    dtype: str
    shape: tuple[int, ...]
    scale_dtype: str = "float32"
    error: EncodingError | None = None


@dataclass(frozen=True)
class TensorMeta:
    """A global tensor: dtype, shape, the layout it was saved from, and its stored chunks.

    With an ``encoding``, dtype, shape and chunks describe the stored form; the values a reader
    gets have the encoding's dtype and shape (:attr:`value_dtype`, :attr:`value_shape`).
    """

    dtype: str
    shape: tuple[int, ...]
    layout: str
    chunks: tuple[ChunkMeta, ...]
    encoding: Encoding | None = None

    @property
    def value_dtype(self) -> str:
        return self.dtype if self.encoding is None else self.encoding.dtype

    @property
    def value_shape(self) -> tuple[int, ...]:
        return self.shape if self.encoding is None else self.encoding.shape


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
    version: int = PLAIN_FORMAT_VERSION
    created_unix_s: float = 0.0
    producer: dict[str, str] = field(default_factory=dict)
    pickled_keys: tuple[str, ...] = ()
    file_refs: tuple[FileRef, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)
    references: tuple[str, ...] = ()
    """Step folders (beside this checkpoint's) whose data files hold some of its chunks; the
    chunks that lie there name those files in ``files`` as ``../<step folder>/<data file>``
    (see :mod:`unickpt.format.references`). Empty for a self-contained checkpoint."""
    chunk_map: ChunkMap | None = None
    """Every tensor's chunk boxes and the file whose index lists each (None where the
    checkpoint has no map): a reader of part of the checkpoint reads only the indexes it needs."""

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for t in self.tensors.values() for c in t.chunks)

    def tensor(self, key: str) -> TensorMeta | None:
        """The tensor stored under ``key`` or under the key it is tied to."""
        found = self.tensors.get(key)
        if found is None and key in self.aliases:
            found = self.tensors.get(self.aliases[key])
        return found

    def keys(self) -> set[str]:
        """Every key of the checkpoint: tensors, tied keys, values, per-rank values."""
        return {*self.tensors, *self.aliases, *self.objects, *self.per_rank}

    def per_rank_value(self, key: str, rank: int) -> tuple[bool, Any]:
        """``(True, encoded value)`` saved by ``rank`` under per-rank ``key``, or ``(False,
        None)`` where that rank did not exist or held no value there."""
        values = self.per_rank.get(key, ())
        if rank < len(values) and not is_absent(values[rank]):
            return True, values[rank]
        return False, None

    def first_per_rank(self, key: str) -> tuple[int, Any] | None:
        """``(rank, encoded value)`` of the lowest rank that saved a value under ``key``."""
        for rank, encoded in enumerate(self.per_rank.get(key, ())):
            if not is_absent(encoded):
                return rank, encoded
        return None


@dataclass(frozen=True)
class CommitRecord:
    """The commit marker: names the metadata file and pins its size and checksum.

    Written last and atomically; a folder without it holds no checkpoint.
    """

    metadata_file: str
    metadata_nbytes: int
    metadata_checksum: str
    save_id: str
    version: int = PLAIN_FORMAT_VERSION
