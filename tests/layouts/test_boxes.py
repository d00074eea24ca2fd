from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.layouts.boxes import Box, box_to_flat_ranges, contiguous_runs, flat_range_to_boxes

shapes = st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple)


@given(shapes, st.data())
@settings(max_examples=300, deadline=None)
def test_flat_range_decomposes_into_contiguous_boxes(
    shape: tuple[int, ...], data: st.DataObject
) -> None:
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    numel = data.draw(st.integers(0, n - start))
    full = torch.arange(n).reshape(shape)
    boxes = flat_range_to_boxes(shape, start, numel)
    pieces = [full[tuple(slice(o, o + ln) for o, ln in zip(b.offsets, b.lengths))] for b in boxes]
    got = torch.cat([p.reshape(-1) for p in pieces]) if pieces else torch.empty(0, dtype=torch.long)
    assert torch.equal(got, torch.arange(start, start + numel))
    assert len(boxes) <= max(1, 2 * len(shape) - 1) or numel == 0


@given(shapes, st.data())
@settings(max_examples=300, deadline=None)
def test_runs_of_a_sub_box_match_indexing(shape: tuple[int, ...], data: st.DataObject) -> None:
    outer = Box.whole(shape)
    offsets = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    lengths = tuple(data.draw(st.integers(1, s - o)) for o, s in zip(offsets, shape))
    inner = Box(offsets, lengths)
    full = torch.arange(math.prod(shape)).reshape(shape)
    starts, run = contiguous_runs(outer, inner)
    got = torch.cat([torch.arange(int(s), int(s) + run) for s in starts])
    want = full[inner.relative_to(outer)].reshape(-1)
    assert torch.equal(got, want)
    ranges = box_to_flat_ranges(shape, inner)
    assert sum(n for _, n in ranges) == inner.numel


def test_intersection() -> None:
    a = Box((0, 0), (4, 4))
    assert a.intersect(Box((2, 3), (5, 5))) == Box((2, 3), (2, 1))
    assert a.intersect(Box((4, 0), (1, 4))) is None
    assert Box((), ()).intersect(Box((), ())) == Box((), ())


def _cells(box: Box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(o, o + n) for o, n in zip(box.offsets, box.lengths))))


@given(st.integers(0, 3), st.data())
@settings(max_examples=400, deadline=None)
def test_intersection_is_the_common_cells(ndim: int, data: st.DataObject) -> None:
    def box() -> Box:
        offsets = tuple(data.draw(st.integers(0, 5)) for _ in range(ndim))
        lengths = tuple(data.draw(st.integers(0, 4)) for _ in range(ndim))
        return Box(offsets, lengths)

    a, b = box(), box()
    common = _cells(a) & _cells(b)
    found = a.intersect(b)
    if not common:
        assert found is None
    else:
        assert found is not None and _cells(found) == common
    assert found == b.intersect(a)
