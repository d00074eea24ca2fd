"""The exact tiling check against a brute-force count of every element, on small shapes."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.layouts.boxes import Box, flat_range_to_boxes
from unickpt.layouts.coverage import format_region, is_grid, tiling_fault

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


def _counts(shape: tuple[int, ...], boxes: list[Box]) -> np.ndarray:
    counts = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        counts[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))] += 1
    return counts


def _check_against_brute_force(shape: tuple[int, ...], boxes: list[Box]) -> None:
    fault = tiling_fault(shape, boxes)
    if not all(b.within(shape) for b in boxes):
        assert fault is not None and fault.kind == "outside"
        assert not fault.region.within(shape)
        return
    counts = _counts(shape, boxes)
    if (counts == 1).all():
        assert fault is None
        return
    assert fault is not None, f"missed: {counts.tolist()}"
    box = fault.region
    region = counts[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]
    assert fault.region.numel > 0
    if fault.kind == "overlap":
        assert (region >= 2).all(), (fault, counts.tolist())
    else:
        assert fault.kind == "gap" and (region == 0).all(), (fault, counts.tolist())


def _guillotine(shape: tuple[int, ...], draw: st.DrawFn) -> list[Box]:
    """A random exact tiling: cut a box along a random dimension, recursively."""
    out, todo = [], [Box.whole(shape)]
    while todo:
        box = todo.pop()
        dims = [d for d in range(box.ndim) if box.lengths[d] > 1]
        if not dims or draw(st.booleans()):
            out.append(box)
            continue
        d = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, box.lengths[d] - 1))
        lo = list(box.lengths)
        lo[d] = cut
        hi_off = list(box.offsets)
        hi_off[d] += cut
        hi_len = list(box.lengths)
        hi_len[d] -= cut
        todo += [Box(box.offsets, tuple(lo)), Box(tuple(hi_off), tuple(hi_len))]
    return out


def _flat_ranges(shape: tuple[int, ...], draw: st.DrawFn) -> list[Box]:
    n = math.prod(shape)
    cuts = sorted(set(draw(st.lists(st.integers(0, n), max_size=5))) | {0, n})
    return [b for a, z in itertools.pairwise(cuts) for b in flat_range_to_boxes(shape, a, z - a)]


@st.composite
def tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """Exact tilings, sometimes damaged: a box dropped, doubled, moved, grown or shrunk."""
    shape = draw(shapes)
    boxes = draw(st.sampled_from([_guillotine, _flat_ranges]))(shape, draw)
    damage = draw(st.sampled_from(["none", "drop", "double", "move", "grow", "shrink"]))
    i = draw(st.integers(0, len(boxes) - 1))
    b = boxes[i]
    d = draw(st.integers(0, len(shape) - 1))
    step = draw(st.sampled_from([-1, 1]))
    if damage == "drop":
        boxes.pop(i)
    elif damage == "double":
        boxes.append(b)
    elif damage == "move":
        boxes[i] = Box(tuple(o + step * (k == d) for k, o in enumerate(b.offsets)), b.lengths)
    elif damage in ("grow", "shrink"):
        sign = 1 if damage == "grow" else -1
        lengths = tuple(n + sign * (k == d) for k, n in enumerate(b.lengths))
        boxes[i] = Box(b.offsets, lengths) if min(lengths) >= 0 else b
    return shape, boxes


@given(tilings())
@settings(max_examples=600, deadline=None)
def test_agrees_with_counting_every_element(case: tuple[tuple[int, ...], list[Box]]) -> None:
    _check_against_brute_force(*case)


@given(shapes, st.data())
@settings(max_examples=300, deadline=None)
def test_random_boxes_agree_with_counting(shape: tuple[int, ...], data: st.DataObject) -> None:
    boxes = []
    for _ in range(data.draw(st.integers(0, 6))):
        offsets = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
        lengths = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
        boxes.append(Box(offsets, lengths))
    _check_against_brute_force(shape, boxes)


def test_the_overlap_that_element_counts_miss() -> None:
    fault = tiling_fault((10,), [Box((0,), (5,)), Box((3,), (5,))])
    assert fault is not None and fault.kind == "overlap" and fault.region == Box((3,), (2,))
    fault = tiling_fault((10,), [Box((0,), (5,)), Box((5,), (3,))])
    assert fault is not None and fault.kind == "gap" and format_region(fault.region) == "[8:10]"


def test_zero_d_and_empty_tensors() -> None:
    assert tiling_fault((), [Box((), ())]) is None
    assert tiling_fault((), []).kind == "gap"  # type: ignore[union-attr]
    assert tiling_fault((), [Box((), ()), Box((), ())]).kind == "overlap"  # type: ignore[union-attr]
    assert tiling_fault((0, 4), []) is None
    assert tiling_fault((3,), [Box((0,), (3,)), Box((1,), (0,))]) is None


def test_large_grids_and_flat_ranges_stay_fast() -> None:
    """n log n: 16,384 grid blocks and 10,000 flat ranges check in a fraction of a second; an
    all-pairs check would compare 10^8 pairs."""
    grid = [Box((i * 8, j * 8), (8, 8)) for i in range(128) for j in range(128)]
    cuts = [0, *sorted({(i * 7919) % (1 << 20) for i in range(1, 10000)}), 1 << 20]
    flat = [
        b for a, z in itertools.pairwise(cuts) for b in flat_range_to_boxes((1024, 1024), a, z - a)
    ]
    assert tiling_fault((1024, 1024), grid) is None
    assert tiling_fault((1024, 1024), flat) is None
    broken = tiling_fault((1024, 1024), [*grid[:-1], Box((1016, 1016), (8, 7))])
    assert broken is not None and format_region(broken.region) == "[1016:1024, 1023:1024]"


def _rows(boxes: list[Box]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([b.offsets for b in boxes]), np.array([b.lengths for b in boxes])


def test_grid_check_accepts_exact_grids_only() -> None:
    grid = [Box((r, c), (2, n)) for r in (0, 2) for c, n in ((0, 1), (1, 2))]
    assert is_grid((4, 3), *_rows(grid))
    assert tiling_fault((4, 3), grid) is None
    assert not is_grid((4, 3), *_rows(grid[:-1]))  # a cell missing
    assert not is_grid((5, 3), *_rows(grid))  # a row short
    shifted = [*grid[:-1], Box((2, 1), (2, 1)), Box((2, 2), (2, 1))]  # not one partition
    assert not is_grid((4, 3), *_rows(shifted))
    assert tiling_fault((4, 3), shifted) is None  # still a tiling: the sweep decides
