"""Whether boxes tile a global tensor exactly: every element held once, none twice, none outside.

Counting elements is not enough: two shards ``[0, 5)`` and ``[3, 8)`` of a 10-element tensor
hold 10 elements between them, yet overlap on ``[3, 5)`` and leave ``[8, 10)`` unheld.

The check sweeps the first dimension: the distinct box starts and ends cut it into slabs, and
within a slab the same boxes are active, so their projections onto the remaining dimensions must
tile those dimensions exactly (checked the same way, recursively; the last dimension is a sorted
scan of intervals). A slab whose active projections are those of the slab before it is skipped,
which makes grids (DTensor and block layouts), flat-range decompositions and column splits cost
``O(n log n)`` for ``n`` boxes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .arrays import distinct_rows
from .boxes import Box

# A box as (starts, ends) per dimension: the sweep's working form.
_Span = tuple[tuple[int, ...], tuple[int, ...]]
# (kind, starts, ends) of a faulty region of the dimensions a sweep looked at.
_Fault = tuple[str, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class TilingFault:
    """Where boxes fail to tile a tensor: ``kind`` is ``overlap``, ``gap`` or ``outside``.

    ``overlap``: every element of ``region`` is held by two boxes or more; ``gap``: no box
    holds any element of ``region``; ``outside``: ``region`` is a box that does not lie inside
    the tensor.
    """

    kind: str
    region: Box

    def describe(self) -> str:
        where = format_region(self.region)
        if self.kind == "overlap":
            return f"elements {where} are held by more than one shard"
        if self.kind == "gap":
            return f"elements {where} are held by no shard"
        return f"a shard covers {where}, outside the tensor"


def format_region(box: Box) -> str:
    """``[0:5, 3:8]``: a box as slices of the global tensor."""
    if not box.ndim:
        return "[] (the 0-d tensor's one element)"
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(box.offsets, box.lengths)) + "]"


def tiling_fault(shape: Sequence[int], boxes: Sequence[Box]) -> TilingFault | None:
    """None when ``boxes`` tile a tensor of ``shape`` exactly, else one faulty region.

    Boxes holding no element are ignored. Equal boxes count twice (they overlap).

    >>> tiling_fault((10,), [Box((0,), (5,)), Box((3,), (5,))]).describe()
    'elements [3:5] are held by more than one shard'
    >>> tiling_fault((2, 2), [Box((0, 0), (1, 2)), Box((1, 0), (1, 2))]) is None
    True
    """
    shape = tuple(int(s) for s in shape)
    for box in boxes:
        if not box.within(shape):
            return TilingFault("outside", box)
    if not shape:
        count = len(boxes)
        if count == 1:
            return None
        return TilingFault("gap" if not count else "overlap", box_of((), ()))
    spans = [(b.offsets, b.ends) for b in boxes if b.numel]
    if any(s == 0 for s in shape):
        return None
    fault = _sweep(spans, shape, 0)
    if fault is None:
        return None
    kind, starts, ends = fault
    return TilingFault(kind, box_of(starts, ends))


def is_grid(shape: Sequence[int], offsets: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether distinct boxes (rows of ``offsets`` and ``lengths``) are exactly the cells of a
    grid over the tensor, so that they tile it; vectorised, for the layouts of DTensors and
    blocks. False says nothing: :func:`tiling_fault` then decides.

    Per dimension, the boxes' distinct intervals must partition ``[0, size)``. Every box is then
    one cell of the grid those partitions make, and distinct boxes as many as the cells are every
    cell once.
    """
    if not len(offsets):
        return False
    cells = 1
    for d, size in enumerate(shape):
        pairs = distinct_rows(np.stack([offsets[:, d], lengths[:, d]], axis=1))
        starts, spans = pairs[:, 0], pairs[:, 1]
        if (spans <= 0).any() or starts[0] != 0 or starts[-1] + spans[-1] != size:
            return False
        if (starts[1:] != starts[:-1] + spans[:-1]).any():
            return False
        cells *= len(pairs)
    return cells == len(offsets)


def box_of(starts: tuple[int, ...], ends: tuple[int, ...]) -> Box:
    return Box(starts, tuple(e - s for s, e in zip(starts, ends)))


def _sweep(spans: list[_Span], shape: tuple[int, ...], dim: int) -> _Fault | None:
    """The first fault of ``spans`` (all inside ``shape``) in dimensions ``dim`` onwards."""
    if dim == len(shape) - 1:
        return _scan(spans, shape[dim], dim)
    rest = shape[dim + 1 :]
    whole_rest = (tuple(0 for _ in rest), rest)
    by_start = sorted(range(len(spans)), key=lambda i: spans[i][0][dim])
    by_end = sorted(range(len(spans)), key=lambda i: spans[i][1][dim])
    cuts = sorted({0, shape[dim], *(s[0][dim] for s in spans), *(s[1][dim] for s in spans)})
    active: dict[int, _Span] = {}
    seen: dict[tuple[_Span, ...], _Fault | None] = {}
    si = ei = 0
    for lo, hi in itertools.pairwise(cuts):
        removed, added = [], []
        while ei < len(by_end) and spans[by_end[ei]][1][dim] <= lo:
            removed.append(_project(active.pop(by_end[ei]), dim))
            ei += 1
        while si < len(by_start) and spans[by_start[si]][0][dim] <= lo:
            i = by_start[si]
            active[i] = spans[i]
            added.append(_project(spans[i], dim))
            si += 1
        if lo > 0 and sorted(removed) == sorted(added):
            continue  # the same projections as the slab before, which was sound
        if not active:
            return "gap", (lo, *whole_rest[0]), (hi, *whole_rest[1])
        projected = tuple(sorted(_project(s, dim) for s in active.values()))
        if projected in seen:
            fault = seen[projected]
        else:
            fault = seen[projected] = _sweep(list(projected), rest, 0)
        if fault is not None:
            kind, starts, ends = fault
            return kind, (lo, *starts), (hi, *ends)
    return None


def _project(span: _Span, dim: int) -> _Span:
    return span[0][dim + 1 :], span[1][dim + 1 :]


def _scan(spans: list[_Span], size: int, dim: int) -> _Fault | None:
    """The first fault of intervals along the last dimension, ``[0, size)``."""
    pos = 0
    for start, end in sorted((s[0][dim], s[1][dim]) for s in spans):
        if start > pos:
            return "gap", (pos,), (start,)
        if start < pos:
            return "overlap", (start,), (min(end, pos),)
        pos = end
    if pos < size:
        return "gap", (pos,), (size,)
    return None
