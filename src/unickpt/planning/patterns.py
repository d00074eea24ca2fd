"""The distinct boxes among the boxes all ranks hold of one tensor, and whether they tile it.

A tensor's boxes come as rows of packed coordinates (:mod:`unickpt.planning.packed`), rank after
rank. What is decided from them alone (which rows are the same box, whether the distinct boxes
tile the tensor) is a :class:`Pattern`; the tensors of a model are split alike (every layer's
``w1`` the same way), so patterns are remembered per (shape, rows) and each distinct one costs
its work once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from ..layouts.boxes import Box
from ..layouts.coverage import TilingFault, is_grid, tiling_fault

# Odd 64-bit multipliers of a row's columns: a row's hash picks its candidates for equality,
# which is then checked exactly.
_MIX = np.array(
    [
        0x9E3779B97F4A7C15,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0xD6E8FEB86659FD93,
        0xFF51AFD7ED558CCD,
        0xC4CEB9FE1A85EC53,
        0x2545F4914F6CDD1D,
        0x94D049BB133111EB,
    ],
    dtype=np.uint64,
)


@dataclass(frozen=True)
class Pattern:
    """``first``: the row where each distinct box is first met (ascending); ``inverse``: the
    distinct box of each row; ``counts``: rows per distinct box; ``fault``: why the distinct
    boxes do not tile the tensor, or None."""

    first: np.ndarray
    inverse: np.ndarray
    counts: np.ndarray
    fault: TilingFault | None

    @property
    def replicated(self) -> bool:
        """Whether some box is held by more than one row."""
        return len(self.first) != len(self.inverse)


_KNOWN: dict[tuple[tuple[int, ...], str, tuple[int, ...], bytes], Pattern] = {}
_KEPT_BYTES_MAX = 256 << 20
_kept_bytes = 0


def pattern_of(shape: tuple[int, ...], rows: np.ndarray) -> Pattern:
    """The pattern of ``rows`` (packed coordinates of ``len(rows[0]) // 2`` dimensions) of a
    tensor of ``shape``; remembered (by a 128-bit digest of the rows) while the patterns kept
    stay under a bound in bytes."""
    global _kept_bytes
    rows = np.ascontiguousarray(rows)
    key = (shape, rows.dtype.str, rows.shape, xxhash.xxh3_128_digest(rows.data))
    found = _KNOWN.get(key)
    if found is not None:
        return found
    found = _pattern(shape, rows)
    size = found.first.nbytes + found.inverse.nbytes + found.counts.nbytes
    if size <= _KEPT_BYTES_MAX // 4:
        if _kept_bytes + size > _KEPT_BYTES_MAX:
            _KNOWN.clear()
            _kept_bytes = 0
        _KNOWN[key] = found
        _kept_bytes += size
    return found


def _pattern(shape: tuple[int, ...], rows: np.ndarray) -> Pattern:
    first, inverse, counts = group_rows(rows)
    dims, ndim = rows.shape[1] // 2, len(shape)
    distinct = rows[first]
    if not len(distinct):  # a tensor with no elements may have no chunk at all
        distinct = np.zeros((0, 2 * ndim), dtype=np.int64)
        dims = ndim
    offsets, lengths = distinct[:, :ndim], distinct[:, dims : dims + ndim]
    fault = None
    inside = bool(((offsets >= 0) & (lengths >= 0) & (offsets + lengths <= shape)).all())
    if not (inside and is_grid(shape, offsets, lengths)):
        boxes = [Box(tuple(o), tuple(n)) for o, n in zip(offsets.tolist(), lengths.tolist())]
        fault = tiling_fault(shape, boxes)
    return Pattern(first, inverse, counts, fault)


def group_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, inverse, counts) of the distinct rows, in the order first met."""
    n, width = rows.shape
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    if width == 0:
        return np.zeros(1, np.int64), np.zeros(n, np.int64), np.array([n], np.int64)
    with np.errstate(over="ignore"):
        hashed = (rows.astype(np.uint64) * _MIX[np.arange(width) % len(_MIX)]).sum(axis=1)
    _, first, inverse, counts = np.unique(
        hashed, return_index=True, return_inverse=True, return_counts=True
    )
    if not np.array_equal(rows[first][inverse], rows):  # two rows of one hash differ
        _, first, inverse, counts = np.unique(
            rows, axis=0, return_index=True, return_inverse=True, return_counts=True
        )
    inverse = inverse.reshape(-1)
    order = np.argsort(first, kind="stable")
    place = np.empty_like(order)
    place[order] = np.arange(len(order))
    return first[order], place[inverse], counts[order]
