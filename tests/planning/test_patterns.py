"""Distinct boxes and the tiling verdict of a tensor's rows, against counting every element."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.layouts.boxes import Box
from unickpt.planning.packed import pack
from unickpt.planning.patterns import pattern_of


@st.composite
def _case(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    cuts = [
        sorted(draw(st.sets(st.integers(1, s - 1), max_size=2))) if s > 1 else [] for s in shape
    ]
    bounds = [[0, *c, s] for c, s in zip(cuts, shape)]
    cells = [
        Box(
            tuple(b[i] for b, i in zip(bounds, idx)),
            tuple(b[i + 1] - b[i] for b, i in zip(bounds, idx)),
        )
        for idx in np.ndindex(*(len(b) - 1 for b in bounds))
    ]
    boxes = draw(st.lists(st.sampled_from(cells), min_size=1, max_size=2 * len(cells)))
    if draw(st.booleans()):  # a stray box anywhere in the tensor
        lo = tuple(draw(st.integers(0, s - 1)) for s in shape)
        boxes.append(Box(lo, tuple(draw(st.integers(1, s - o)) for o, s in zip(lo, shape))))
    return shape, boxes


@settings(max_examples=300, deadline=None)
@given(_case())
def test_pattern_dedups_rows_and_agrees_with_counting(
    case: tuple[tuple[int, ...], list[Box]],
) -> None:
    shape, boxes = case
    rows = pack([("t", "float32", shape, "sharded", tuple(boxes))], (), (), {}).coords
    pattern = pattern_of(shape, rows)
    distinct = list(dict.fromkeys(boxes))
    assert [boxes[i] for i in pattern.first.tolist()] == distinct
    assert [distinct[j] for j in pattern.inverse.tolist()] == boxes
    assert pattern.counts.tolist() == [boxes.count(b) for b in distinct]
    counts = np.zeros(shape, dtype=np.int64)
    for b in distinct:
        counts[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))] += 1
    assert (pattern.fault is None) == bool((counts == 1).all())


def test_patterns_are_remembered_per_split() -> None:
    boxes = (Box((0, 0), (2, 3)), Box((2, 0), (2, 3)))
    rows = pack([("t", "float32", (4, 3), "sharded", boxes)], (), (), {}).coords
    assert pattern_of((4, 3), rows) is pattern_of((4, 3), rows.copy())
    assert pattern_of((4, 3), rows).fault is None
    assert pattern_of((5, 3), rows) is not pattern_of((4, 3), rows)
    assert pattern_of((5, 3), rows).fault is not None
