"""An index file decoded into arrays per tensor, not an object per chunk.

A loading rank that reads indexes of thousands of chunks needs, per tensor, the chunks' boxes
(to match them against what it loads) and, only for the few chunks it reads, their byte ranges
and checksums. :func:`decode_index_arrays` reads the same JSON as
:func:`unickpt.format.codec.decode_index` (versions 1 and 2) into one :class:`TensorChunks` per
tensor: offsets and lengths as one int64 matrix, byte offsets, sizes and file numbers as int64
vectors, the checksums as one flat list; :meth:`TensorChunks.chunk` builds the
:class:`ChunkMeta` of one chunk when it is read. Decoding costs a few array conversions per
index, not work per tensor: the rows of all tensors are decoded at once
(:class:`IndexChunks`) and split per tensor when asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError
from .codec import (
    INDEX_FORMAT,
    check_header,
    decode_compression,
    decode_runs,
    load_json,
    no_checksums,
)
from .limits import MAX_NDIM
from .metadata import ChunkMeta, Compression
from .references import FileLocation, FileTable


@dataclass(frozen=True, eq=False)
class TensorChunks:
    """Chunks of one tensor: ``coords`` (one int64 row per chunk: offsets, then lengths),
    ``byte_offsets``, ``nbytes`` and ``files`` (file numbers); chunk ``i``'s checksums are
    ``sums[sum_starts[i]:sum_starts[i + 1]]``."""

    ndim: int
    coords: np.ndarray
    byte_offsets: np.ndarray
    nbytes: np.ndarray
    files: np.ndarray
    sums: list[str]
    sum_starts: np.ndarray
    packed: dict[int, Compression] = field(default_factory=dict)
    """The compression of each compressed chunk, by its position."""

    def __len__(self) -> int:
        return len(self.files)

    def chunk(self, i: int) -> ChunkMeta:
        row = self.coords[i].tolist()
        a, b = self.sum_starts[i : i + 2].tolist()
        return ChunkMeta(
            tuple(row[: self.ndim]),
            tuple(row[self.ndim :]),
            int(self.files[i]),
            int(self.byte_offsets[i]),
            int(self.nbytes[i]),
            tuple(self.sums[a:b]),
            self.packed.get(i),
        )

    def chunks(self) -> list[ChunkMeta]:
        return [self.chunk(i) for i in range(len(self))]


@dataclass(frozen=True, eq=False)
class IndexChunks:
    """The chunks of one or more indexes, one row each, in the order listed: ``keys`` (the
    tensors, in the order first listed), ``key_ids`` (each row's position in ``keys``),
    ``ndims`` (each row's dimensions), ``coords`` (offsets, then lengths, padded to the most
    dimensions with offset 0 and length 1), ``byte_offsets``, ``nbytes``, ``files`` and the
    checksums (``sums``, ``sum_starts``) as in :class:`TensorChunks`."""

    keys: list[str]
    key_ids: np.ndarray
    ndims: np.ndarray
    coords: np.ndarray
    byte_offsets: np.ndarray
    nbytes: np.ndarray
    files: np.ndarray
    sums: list[str]
    sum_starts: np.ndarray
    packed: dict[int, Compression] = field(default_factory=dict)
    """The compression of each compressed chunk, by its row."""

    def by_key(self) -> dict[str, np.ndarray]:
        """The rows of each tensor, in the order listed."""
        order = np.argsort(self.key_ids, kind="stable")
        ends = np.searchsorted(self.key_ids[order], np.arange(len(self.keys) + 1))
        return {k: order[ends[i] : ends[i + 1]] for i, k in enumerate(self.keys)}

    def chunk_list(self, key: str, rows: np.ndarray) -> list[ChunkMeta]:
        """The chunks of ``key`` at ``rows`` (at least one) as objects, for a tensor of a few."""
        ndims = self.ndims[rows].tolist()
        ndim = ndims[0]
        if any(n != ndim for n in ndims):
            raise _mixed_dims(key)
        dims = self.coords.shape[1] // 2
        starts = self.sum_starts[rows].tolist()
        ends = self.sum_starts[rows + 1].tolist()
        return [
            ChunkMeta(
                tuple(c[:ndim]),
                tuple(c[dims : dims + ndim]),
                f,
                b,
                n,
                tuple(self.sums[a:e]),
                self.packed.get(r),
            )
            for c, f, b, n, a, e, r in zip(
                self.coords[rows].tolist(),
                self.files[rows].tolist(),
                self.byte_offsets[rows].tolist(),
                self.nbytes[rows].tolist(),
                starts,
                ends,
                rows.tolist(),
            )
        ]

    def tensor(self, key: str, rows: np.ndarray | None = None) -> TensorChunks:
        """The chunks of ``key`` (at ``rows``, default all of its rows)."""
        if rows is None:
            rows = self.by_key()[key]
        ndim = int(self.ndims[rows[0]]) if len(rows) else 0
        if len(rows) and (self.ndims[rows] != ndim).any():
            raise _mixed_dims(key)
        dims = self.coords.shape[1] // 2
        coords = self.coords[rows]
        starts = self.sum_starts[rows]
        counts = self.sum_starts[rows + 1] - starts
        sums = [s for a, n in zip(starts.tolist(), counts.tolist()) for s in self.sums[a : a + n]]
        return TensorChunks(
            ndim,
            np.concatenate([coords[:, :ndim], coords[:, dims : dims + ndim]], axis=1),
            self.byte_offsets[rows],
            self.nbytes[rows],
            self.files[rows],
            sums,
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            _packed_at(self.packed, rows),
        )


def _packed_at(packed: dict[int, Compression], rows: np.ndarray) -> dict[int, Compression]:
    """The compressions of ``rows``, by their position in ``rows``."""
    if not packed:
        return {}
    return {i: packed[r] for i, r in enumerate(rows.tolist()) if r in packed}


def _mixed_dims(key: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"the indexes list chunks of '{key}' with different numbers of dimensions; "
        "the checkpoint is damaged. Load an earlier checkpoint."
    )


def concat_indexes(parts: Sequence[IndexChunks]) -> IndexChunks:
    """The rows of several decoded indexes, one after the other."""
    if len(parts) == 1:
        return parts[0]
    keys: dict[str, int] = {}
    key_ids = []
    for p in parts:
        table = np.array([keys.setdefault(k, len(keys)) for k in p.keys], dtype=np.int64)
        key_ids.append(table[p.key_ids] if len(p.key_ids) else p.key_ids)
    dims = max(p.coords.shape[1] // 2 for p in parts)
    shifts = np.cumsum([0] + [len(p.sums) for p in parts[:-1]]).tolist()
    row_shifts = np.cumsum([0] + [len(p.files) for p in parts[:-1]]).tolist()
    packed = {r + shift: c for p, shift in zip(parts, row_shifts) for r, c in p.packed.items()}
    return IndexChunks(
        list(keys),
        np.concatenate(key_ids),
        np.concatenate([p.ndims for p in parts]),
        np.concatenate([widen(p.coords, dims) for p in parts]),
        np.concatenate([p.byte_offsets for p in parts]),
        np.concatenate([p.nbytes for p in parts]),
        np.concatenate([p.files for p in parts]),
        [s for p in parts for s in p.sums],
        np.concatenate(
            [
                *(p.sum_starts[:-1] + s for p, s in zip(parts, shifts)),
                [shifts[-1] + len(parts[-1].sums)],
            ]
        ).astype(np.int64),
        packed,
    )


def widen(coords: np.ndarray, dims: int) -> np.ndarray:
    """``coords`` (offsets, then lengths) of fewer dimensions padded to ``dims`` (offset 0,
    length 1)."""
    have = coords.shape[1] // 2
    if have == dims:
        return coords
    out = np.zeros((len(coords), 2 * dims), dtype=coords.dtype)
    out[:, dims:] = 1
    out[:, :have] = coords[:, :have]
    out[:, dims : dims + have] = coords[:, have:]
    return out


def decode_index_arrays(
    raw: bytes, source: str, file: int, files: FileTable | None = None
) -> IndexChunks:
    """The chunks of an index as arrays; chunks in this index's data file get number ``file``,
    chunks that refer to an earlier checkpoint's file the number ``files`` gives it (as
    :func:`~unickpt.format.codec.decode_index` numbers them)."""
    doc = load_json(raw, source)
    check_header(doc, source, INDEX_FORMAT)
    try:
        refs = [FileLocation(str(step), str(data)) for step, data in doc.get("refs", [])]
        rows = list(doc["chunks"])
        runs = [c for run in doc.get("runs", []) for c in decode_runs(run, file, refs, files)]
        found = _decode(rows + [_row(k, c) for k, c in runs], file, refs, files, source)
        if runs:  # numbered by decode_runs
            found.files[len(rows) :] = [c.file for _, c in runs]
        return found
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
        raise CheckpointCorruptError(
            f"{source}: the index is not well formed ({type(e).__name__}: {e}); the "
            "checkpoint is damaged. Load an earlier checkpoint."
        ) from e


def _row(key: str, c: ChunkMeta) -> list[Any]:
    return [key, list(c.offsets), list(c.lengths), c.byte_offset, c.nbytes, list(c.checksums)]


def _decode(
    rows: list[list[Any]],
    own: int,
    refs: list[FileLocation],
    files: FileTable | None,
    source: str,
) -> IndexChunks:
    n = len(rows)
    if any(not 6 <= len(r) <= 8 for r in rows):
        raise ValueError("a chunk entry has fewer than 6 or more than 8 elements")
    keys: dict[str, int] = {}
    key_ids = np.fromiter((keys.setdefault(str(r[0]), len(keys)) for r in rows), np.int64, n)
    ndims = np.fromiter((len(r[1]) for r in rows), np.int64, n)
    differ = np.flatnonzero(np.fromiter((len(r[2]) for r in rows), np.int64, n) != ndims)
    if len(differ):
        r = rows[int(differ[0])]
        raise ValueError(f"chunk of '{r[0]}' has {len(r[1])} offsets and {len(r[2])} lengths")
    dims = int(ndims.max()) if n else 0
    if dims > MAX_NDIM:  # rows are padded to the widest: bound it before allocating
        r = rows[int(np.argmax(ndims))]
        raise ValueError(f"chunk of '{r[0]}' has {dims} offsets, more than {MAX_NDIM}")
    if n and (ndims == dims).all():
        coords = np.array([r[1] + r[2] for r in rows], dtype=np.int64).reshape(n, 2 * dims)
    else:
        coords = np.zeros((n, 2 * dims), dtype=np.int64)
        coords[:, dims:] = 1
        for i, r in enumerate(rows):
            k = len(r[1])
            coords[i, :k], coords[i, dims : dims + k] = r[1], r[2]
    places = np.array([r[3:5] for r in rows], dtype=np.int64).reshape(n, 2)
    negative = np.flatnonzero((places < 0).any(axis=1))
    if len(negative):
        i = int(negative[0])
        raise ValueError(f"chunk of '{rows[i][0]}' at offset {int(places[i, 0])}")
    if any(not isinstance(r[5], list) for r in rows):
        raise TypeError("the checksums of a chunk are not a list")
    counts = np.fromiter((len(r[5]) for r in rows), np.int64, n)
    if n and not counts.all():
        raise no_checksums(str(rows[int(np.argmin(counts))][0]), source)
    sums = [str(c) for r in rows for c in r[5]]
    where = np.full(n, own, dtype=np.int64)
    numbers: dict[int, int] = {}
    packed: dict[int, Compression] = {}
    for i, r in enumerate(rows):
        if len(r) >= 7 and r[6] is not None:
            where[i] = _file_number(r[6], refs, files, numbers)
        if len(r) == 8:
            packed[i] = decode_compression(r[7], str(r[0]), int(r[4]), len(r[5]))
    return IndexChunks(
        list(keys),
        key_ids,
        ndims,
        coords,
        places[:, 0].copy(),
        places[:, 1].copy(),
        where,
        sums,
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        packed,
    )


def _file_number(
    ref: Any, refs: list[FileLocation], files: FileTable | None, numbers: dict[int, int]
) -> int:
    if not isinstance(ref, int) or not 0 <= ref < len(refs):
        raise ValueError(f"reference {[ref]} is not one of the index's {len(refs)} refs")
    if files is None:
        raise ValueError("a chunk refers to another checkpoint's file; read it with its refs")
    found = numbers.get(ref)
    if found is None:
        found = numbers[ref] = files.number(refs[ref])
    return found
