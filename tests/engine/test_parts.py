"""The parts a data file is cut into: exact tiling, minimum sizes, whole checksum segments."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.engine.parts import Part, PartRules, plan_parts

SEGMENT = 64


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[bool], PartRules]:
    """Items laid out as in a data file (gaps of alignment padding) and the rules to cut it."""
    sizes = draw(st.lists(st.integers(0, 40 * SEGMENT), max_size=25))
    gaps = draw(st.lists(st.integers(0, 63), min_size=len(sizes), max_size=len(sizes)))
    splittable = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    extents, end = [], 0
    for size, gap in zip(sizes, gaps):
        offset = end + (gap if extents else 0)
        extents.append((offset, size))
        end = offset + size
    rules = PartRules(
        target_bytes=SEGMENT * draw(st.integers(1, 12)),
        segment_bytes=SEGMENT,
        small_bytes=draw(st.integers(1, 6 * SEGMENT)),
        min_bytes=draw(st.sampled_from([0, 1, 5 * SEGMENT, 7 * SEGMENT + 3])),
    )
    return extents, splittable, rules


def _file_end(extents: list[tuple[int, int]]) -> int:
    return extents[-1][0] + extents[-1][1] if extents else 0


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_parts_tile_the_file_and_respect_the_rules(
    case: tuple[list[tuple[int, int]], list[bool], PartRules],
) -> None:
    extents, splittable, rules = case
    parts = plan_parts(extents, splittable, rules)
    assert parts, "every file has at least one part"
    assert [p.index for p in parts] == list(range(len(parts)))
    pos = 0
    for p in parts:
        assert p.offset == pos
        assert p.nbytes == sum(s.nbytes for s in p.spans)
        pos += p.nbytes
    assert pos == _file_end(extents)
    for p in parts[:-1]:
        assert p.nbytes >= max(rules.min_bytes, rules.target_bytes)
    _check_spans(parts, extents, splittable, rules)


def _check_spans(
    parts: list[Part], extents: list[tuple[int, int]], splittable: list[bool], rules: PartRules
) -> None:
    """Each item's bytes appear once, in order, at their file offset; the rest is padding;
    pieces of cut items start and end on segment boundaries of the item."""
    pieces: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(extents))}
    pos = 0
    for p in parts:
        for s in p.spans:
            if s.item is None:
                assert s.nbytes > 0 and not any(o <= pos < o + n for o, n in extents if n)
            else:
                assert pos == extents[s.item][0] + s.start
                pieces[s.item].append((s.start, s.nbytes))
            pos += s.nbytes
    for i, (_, size) in enumerate(extents):
        got = pieces[i]
        assert got[0][0] == 0 and sum(n for _, n in got) == size
        assert all(a + n == b for (a, n), (b, _) in pairwise(got))
        if len(got) > 1:
            assert splittable[i] and size >= rules.small_bytes
            for start, n in got:
                assert start % rules.segment_bytes == 0
                assert (start + n) % rules.segment_bytes == 0 or start + n == size


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_parts_are_not_much_larger_than_needed(
    case: tuple[list[tuple[int, int]], list[bool], PartRules],
) -> None:
    """A part closes once it reaches its size; only an uncut item or a segment overshoots it."""
    extents, splittable, rules = case
    whole = max((n for _, n in extents), default=0)
    for p in plan_parts(extents, splittable, rules):
        assert p.nbytes < rules.part_bytes + max(whole, rules.segment_bytes, 64)


def test_examples() -> None:
    rules = PartRules(target_bytes=4 * SEGMENT, segment_bytes=SEGMENT, small_bytes=2 * SEGMENT)
    # a big chunk cut in target-sized pieces; its tail shares a part with small chunks
    parts = plan_parts([(0, 10 * SEGMENT), (640, 10), (704, 20)], [True, True, True], rules)
    assert [p.nbytes for p in parts] == [256, 256, 212]
    assert [(s.item, s.start, s.nbytes) for s in parts[2].spans] == [
        (0, 512, 128),
        (1, 0, 10),
        (None, 0, 54),
        (2, 0, 20),
    ]
    # a chunk that is not contiguous CPU memory stays whole
    parts = plan_parts([(0, 10 * SEGMENT)], [False], rules)
    assert [(p.nbytes, len(p.spans)) for p in parts] == [(640, 1)]
    # an object store's minimum part size wins over a smaller target
    big = PartRules(SEGMENT, SEGMENT, 1, min_bytes=5 * SEGMENT)
    assert [p.nbytes for p in plan_parts([(0, 12 * SEGMENT)], [True], big)] == [320, 320, 128]
    # an empty file is one empty part
    assert [p.nbytes for p in plan_parts([(0, 0)], [True], rules)] == [0]
    assert plan_parts([], [], rules)[0].nbytes == 0
