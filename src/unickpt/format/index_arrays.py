"""An index file decoded into arrays per tensor, not an object per chunk.

A loading rank that reads indexes of thousands of chunks needs, per tensor, the chunks' boxes
(to match them against what it loads) and, only for the few chunks it reads, their byte ranges
and checksums. :func:`decode_index_arrays` reads the same JSON as
:func:`unickpt.format.codec.decode_index` (versions 1 and 2) into one :class:`TensorChunks` per
tensor: offsets and lengths as one int64 matrix, byte offsets, sizes and file numbers as int64
vectors, the checksums as one flat list; :meth:`TensorChunks.chunk` builds the
:class:`ChunkMeta` of one chunk when it is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError
from .codec import INDEX_FORMAT, check_header, load_json
from .metadata import ChunkMeta
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
        )

    def chunks(self) -> list[ChunkMeta]:
        return [self.chunk(i) for i in range(len(self))]

    def take(self, rows: np.ndarray) -> TensorChunks:
        """The chunks at positions ``rows``, in that order."""
        starts = self.sum_starts[rows]
        counts = self.sum_starts[rows + 1] - starts
        sums = [s for a, n in zip(starts.tolist(), counts.tolist()) for s in self.sums[a : a + n]]
        return TensorChunks(
            self.ndim,
            self.coords[rows],
            self.byte_offsets[rows],
            self.nbytes[rows],
            self.files[rows],
            sums,
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        )


def concat_chunks(parts: Sequence[TensorChunks]) -> TensorChunks:
    """The chunks of several indexes of one tensor, one after the other."""
    if len(parts) == 1:
        return parts[0]
    ndims = {p.ndim for p in parts}
    if len(ndims) != 1:
        raise ValueError(f"chunks of one tensor have {sorted(ndims)} dimensions")
    shifts = np.cumsum([0] + [len(p.sums) for p in parts[:-1]])
    starts = [p.sum_starts[:-1] + s for p, s in zip(parts, shifts.tolist())]
    return TensorChunks(
        parts[0].ndim,
        np.concatenate([p.coords for p in parts]),
        np.concatenate([p.byte_offsets for p in parts]),
        np.concatenate([p.nbytes for p in parts]),
        np.concatenate([p.files for p in parts]),
        [s for p in parts for s in p.sums],
        np.concatenate([*starts, [sum(len(p.sums) for p in parts)]]).astype(np.int64),
    )


def decode_index_arrays(
    raw: bytes, source: str, file: int, files: FileTable | None = None
) -> dict[str, TensorChunks]:
    """The chunks of an index per tensor (tensors in the order first listed, chunks in the
    order listed); chunks in this index's data file get number ``file``, chunks that refer to
    an earlier checkpoint's file the number ``files`` gives it (as
    :func:`~unickpt.format.codec.decode_index` numbers them)."""
    doc = load_json(raw, source)
    check_header(doc, source, INDEX_FORMAT)
    try:
        refs = [FileLocation(str(step), str(data)) for step, data in doc.get("refs", [])]
        by_key: dict[str, list[list[Any]]] = {}
        numbers: dict[int, int] = {}
        for row in doc["chunks"]:
            if not 6 <= len(row) <= 7:
                raise ValueError(f"a chunk entry has {len(row)} elements, expected 6 or 7")
            if len(row) == 7:  # numbered in the order listed, as decode_index numbers them
                _file_number(row[6], refs, files, numbers)
            by_key.setdefault(str(row[0]), []).append(row)
        out = {key: _tensor(key, rows, file, refs, files, numbers) for key, rows in by_key.items()}
        return out
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
        raise CheckpointCorruptError(
            f"{source}: the index is not well formed ({type(e).__name__}: {e}); the "
            "checkpoint is damaged. Load an earlier checkpoint."
        ) from e


def _tensor(
    key: str,
    rows: list[list[Any]],
    own: int,
    refs: list[FileLocation],
    files: FileTable | None,
    numbers: dict[int, int],
) -> TensorChunks:
    offsets = np.array([r[1] for r in rows], dtype=np.int64)
    lengths = np.array([r[2] for r in rows], dtype=np.int64)
    if offsets.ndim != 2 or offsets.shape != lengths.shape:
        raise ValueError(f"chunks of '{key}' have offsets and lengths of different sizes")
    places = np.array([r[3:5] for r in rows], dtype=np.int64).reshape(len(rows), 2)
    if (places < 0).any():
        raise ValueError(f"chunk of '{key}' at offset {int(places.min())}")
    sums: list[str] = []
    counts = np.empty(len(rows), dtype=np.int64)
    for i, r in enumerate(rows):
        if not isinstance(r[5], list):
            raise TypeError(f"the checksums of a chunk of '{key}' are not a list")
        counts[i] = len(r[5])
        sums.extend(str(c) for c in r[5])
    where = np.full(len(rows), own, dtype=np.int64)
    for i, r in enumerate(rows):
        if len(r) == 7:
            where[i] = _file_number(r[6], refs, files, numbers)
    return TensorChunks(
        offsets.shape[1],
        np.concatenate([offsets, lengths], axis=1),
        places[:, 0].copy(),
        places[:, 1].copy(),
        where,
        sums,
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
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
