"""Boxes and flat ranges of a global tensor, and the arithmetic between them.

A *box* is a rectangular block of a global tensor: an offset and a length per dimension. A *flat
range* is a run ``[start, start + numel)`` of the global tensor's row-major flattening. Every
shard unickpt stores is a box whose bytes are laid out row-major; a flat range is stored as the
few boxes it decomposes into (a partial first row, full rows, a partial last row, recursively).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np


class Box(NamedTuple):
    """A block ``[offsets, offsets + lengths)`` of a global tensor.

    Immutable; a named tuple, so hashing and comparing boxes (planning dedups and matches
    hundreds of thousands of them) run at C speed.
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @staticmethod
    def whole(shape: Sequence[int]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def intersect(self, other: Box) -> Box | None:
        """The common block of two boxes, or None when they do not overlap."""
        offsets: list[int] = []
        lengths: list[int] = []
        for a, n, b, m in zip(self.offsets, self.lengths, other.offsets, other.lengths):
            start = a if a > b else b
            end = min(a + n, b + m)
            if end <= start:
                return None
            offsets.append(start)
            lengths.append(end - start)
        return Box(tuple(offsets), tuple(lengths))

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """Slices that cut this box out of a tensor holding ``outer``."""
        return tuple(
            slice(o - oo, o - oo + n) for o, n, oo in zip(self.offsets, self.lengths, outer.offsets)
        )

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(
            o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape)
        )


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    return tuple(strides)


def flat_range_to_boxes(shape: Sequence[int], start: int, numel: int) -> list[Box]:
    """Decompose a flat range of a row-major tensor of ``shape`` into contiguous boxes.

    The boxes come in flattening order; each is contiguous in the flattening, so box ``i``
    occupies ``[start + sum(numel of boxes before i), ...)``.

    >>> [(b.offsets, b.lengths) for b in flat_range_to_boxes((3, 4), 2, 7)]
    [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 1))]
    """
    shape = tuple(int(s) for s in shape)
    if numel <= 0 or math.prod(shape) == 0:
        return []
    return [Box(o, n) for o, n in _decompose(shape, start, start + numel)]


def _decompose(
    shape: tuple[int, ...], start: int, end: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    if start >= end:
        return
    if not shape:
        yield (), ()
        return
    rest = shape[1:]
    row = math.prod(rest)
    if start % row:
        first = start // row
        stop = min(end, (first + 1) * row)
        for o, n in _decompose(rest, start - first * row, stop - first * row):
            yield (first, *o), (1, *n)
        start = stop
    full = end // row - start // row
    if start < end and full > 0:
        yield (start // row, *(0 for _ in rest)), (full, *rest)
        start += full * row
    if start < end:
        last = start // row
        for o, n in _decompose(rest, 0, end - last * row):
            yield (last, *o), (1, *n)


def box_to_flat_ranges(shape: Sequence[int], box: Box) -> list[tuple[int, int]]:
    """The flat ranges ``(start, numel)`` a box covers in a row-major tensor, merged."""
    starts, run = contiguous_runs(Box.whole(shape), box)
    return [(int(s), run) for s in starts]


def contiguous_runs(outer: Box, inner: Box) -> tuple[np.ndarray, int]:
    """Where ``inner`` lies in the row-major storage of ``outer``, in elements.

    Returns ``(starts, run)``: the ascending element offsets of the contiguous runs and the
    length of each run. ``inner`` must lie inside ``outer``.
    """
    if inner.numel == 0:
        return np.zeros(0, dtype=np.int64), 0
    ndim = outer.ndim
    if ndim == 0:
        return np.zeros(1, dtype=np.int64), 1
    strides = row_major_strides(outer.lengths)
    rel = [i - o for i, o in zip(inner.offsets, outer.offsets)]
    k = ndim - 1
    while k > 0 and inner.lengths[k] == outer.lengths[k]:
        k -= 1
    run = inner.lengths[k] * strides[k]
    base = sum(r * s for r, s in zip(rel, strides))
    starts = np.full(1, base, dtype=np.int64)
    for d in range(k):
        steps = np.arange(inner.lengths[d], dtype=np.int64) * strides[d]
        starts = (starts[:, None] + steps[None, :]).reshape(-1)
    return starts, run


def split_box(box: Box, max_numel: int) -> list[Box]:
    """Cut ``box`` into row-major consecutive sub-boxes of at most ``max_numel`` elements."""
    if box.numel <= max_numel or box.ndim == 0:
        return [box]
    d = next(i for i, n in enumerate(box.lengths) if n > 1)
    inner = math.prod(box.lengths[d + 1 :])
    if inner > max_numel:
        out = []
        for i in range(box.lengths[d]):
            offsets = list(box.offsets)
            lengths = list(box.lengths)
            offsets[d] += i
            lengths[d] = 1
            out.extend(split_box(Box(tuple(offsets), tuple(lengths)), max_numel))
        return out
    step = max(1, max_numel // inner)
    out = []
    for start in range(0, box.lengths[d], step):
        offsets = list(box.offsets)
        lengths = list(box.lengths)
        offsets[d] += start
        lengths[d] = min(step, box.lengths[d] - start)
        out.append(Box(tuple(offsets), tuple(lengths)))
    return out
