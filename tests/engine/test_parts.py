"""The parts a data file is cut into: exact tiling, minimum sizes, whole checksum segments."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.engine.parts import Part, PartRules, Span, plan_parts
from unickpt.errors import CheckpointError
from unickpt.storage.s3 import S3Storage

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
        max_parts=draw(st.sampled_from([None, 1, 2, 3, 10])),
        max_bytes=draw(st.sampled_from([None, None, 16 * SEGMENT, 40 * SEGMENT])),
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
    try:
        parts = plan_parts(extents, splittable, rules)
    except CheckpointError as e:  # only where the limits leave no way
        cap = rules.cap_bytes()
        assert cap is not None and rules.least_bytes(_file_end(extents)) > cap
        assert "does not fit in" in str(e)
        return
    assert parts, "every file has at least one part"
    assert [p.index for p in parts] == list(range(len(parts)))
    pos = 0
    for p in parts:
        assert p.offset == pos
        assert p.nbytes == sum(s.nbytes for s in p.spans)
        pos += p.nbytes
    assert pos == _file_end(extents)
    for p in parts[:-1]:
        assert p.nbytes >= max(rules.min_bytes, 1)
    if rules.max_parts is not None:
        assert len(parts) <= rules.max_parts
    if rules.max_bytes is not None:
        assert max(p.nbytes for p in parts) <= rules.max_bytes
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
            assert (splittable[i] or rules.must_cut(size)) and size >= rules.small_bytes
            for start, n in got:
                assert start % rules.segment_bytes == 0
                assert (start + n) % rules.segment_bytes == 0 or start + n == size


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_parts_are_not_much_larger_than_needed(
    case: tuple[list[tuple[int, int]], list[bool], PartRules],
) -> None:
    """A part closes once it reaches its size; only an uncut item or a segment overshoots it.
    Parts below that size end at a large chunk's boundary, or are the last."""
    extents, splittable, rules = case
    rules = replace(rules, max_bytes=None)
    whole = max((n for _, n in extents), default=0)
    close_at = rules.close_bytes(_file_end(extents))
    parts = plan_parts(extents, splittable, rules)
    for p in parts:
        assert p.nbytes < close_at + max(whole, rules.segment_bytes) + 64  # 64: the padding
    large = {i for i, (_, n) in enumerate(extents) if n and n >= rules.small_bytes}
    for p, after in pairwise(parts):
        if p.nbytes < close_at:
            last = [s for s in p.spans if s.item is not None][-1]
            first = next(s for s in after.spans if s.item is not None)
            ends_large = last.item in large and last.start + last.nbytes == extents[last.item][1]
            assert ends_large or (first.item in large and first.start == 0)


def test_examples() -> None:
    rules = PartRules(target_bytes=4 * SEGMENT, segment_bytes=SEGMENT, small_bytes=2 * SEGMENT)
    # a big chunk cut in target-sized pieces, ending its own part; small chunks share one
    parts = plan_parts([(0, 10 * SEGMENT), (640, 10), (704, 20)], [True, True, True], rules)
    assert [p.nbytes for p in parts] == [256, 256, 128, 84]
    assert [(s.item, s.start, s.nbytes) for s in parts[3].spans] == [
        (1, 0, 10),
        (None, 0, 54),
        (2, 0, 20),
    ]
    assert plan_parts([(0, 10), (64, 100), (192, 20)], [True] * 3, PartRules(64, 64, 32)) == [
        Part(0, 0, 64, (Span(0, 0, 10), Span(None, 0, 54))),
        Part(1, 64, 64, (Span(1, 0, 64),)),
        Part(2, 128, 64, (Span(1, 64, 36), Span(None, 0, 28))),
        Part(3, 192, 20, (Span(2, 0, 20),)),
    ]
    # with an object store's minimum, a small part is not closed at a chunk boundary
    s3 = PartRules(4 * SEGMENT, SEGMENT, 2 * SEGMENT, min_bytes=3 * SEGMENT)
    parts = plan_parts([(0, 10 * SEGMENT), (640, 10), (704, 20)], [True, True, True], s3)
    assert [p.nbytes for p in parts] == [256, 256, 212]
    # at most max_parts: parts grow
    few = PartRules(SEGMENT, SEGMENT, 1, max_parts=3)
    assert [p.nbytes for p in plan_parts([(0, 12 * SEGMENT)], [True], few)] == [384, 384]
    # a chunk that is not contiguous CPU memory stays whole
    parts = plan_parts([(0, 10 * SEGMENT)], [False], rules)
    assert [(p.nbytes, len(p.spans)) for p in parts] == [(640, 1)]
    # an object store's minimum part size wins over a smaller target
    big = PartRules(SEGMENT, SEGMENT, 1, min_bytes=5 * SEGMENT)
    assert [p.nbytes for p in plan_parts([(0, 12 * SEGMENT)], [True], big)] == [320, 320, 128]
    # without a minimum, every large chunk is its own part (one positional write each)
    local = PartRules(64 * SEGMENT, SEGMENT, 2 * SEGMENT)
    parts = plan_parts([(0, 3 * SEGMENT), (192, 5), (256, 2 * SEGMENT)], [True] * 3, local)
    assert [p.nbytes for p in parts] == [192, 64, 128]
    # an empty file is one empty part
    assert [p.nbytes for p in plan_parts([(0, 0)], [True], rules)] == [0]
    assert plan_parts([], [], rules)[0].nbytes == 0


MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40
S3_RULES = PartRules(
    target_bytes=64 * MiB,
    segment_bytes=MiB,
    small_bytes=MiB,
    min_bytes=S3Storage.min_part_bytes,
    max_parts=S3Storage.max_parts,
    max_bytes=S3Storage.max_part_bytes,
)


def _check_s3(parts: list[Part], file_bytes: int) -> None:
    assert S3Storage.max_part_bytes == 5 * GiB and S3Storage.max_parts == 10_000
    assert sum(p.nbytes for p in parts) == file_bytes
    assert len(parts) <= 10_000
    assert max(p.nbytes for p in parts) <= 5 * GiB
    assert min((p.nbytes for p in parts[:-1]), default=5 * MiB) >= 5 * MiB


@pytest.mark.parametrize(
    "file_bytes", [1, 5 * MiB - 1, 5 * MiB, 64 * MiB + 1, 5 * GiB + 1, 50 * GiB, TiB, 36 * TiB]
)
@pytest.mark.parametrize("contiguous", [True, False])
def test_s3_limits_for_one_chunk_of_any_size(file_bytes: int, contiguous: bool) -> None:
    """One chunk of any size up to 36 TiB fits S3's limits (5 MiB to 5 GiB parts, at most
    10,000), also when its source is not contiguous (then it is cut above 1.25 GiB)."""
    parts = plan_parts([(0, file_bytes)], [contiguous], S3_RULES)
    _check_s3(parts, file_bytes)
    if not contiguous and file_bytes <= 5 * GiB // 4:
        assert len(parts) == 1  # copied whole once
    if file_bytes == 50 * GiB:
        assert [p.nbytes for p in parts[:2]] == [64 * MiB, 64 * MiB] and len(parts) == 800
    if file_bytes == 36 * TiB:  # parts grow to stay within 10,000
        least = -(-file_bytes // 9_999)  # every part but the last holds at least this
        assert parts[0].nbytes == -(-least // MiB) * MiB and len(parts) == 9_998


def test_s3_limits_for_many_chunks() -> None:
    """Small and large chunks mixed, contiguous and not, 20 TiB in all."""
    extents, splittable, end = [], [], 0
    for i in range(4_000):
        size = [100, 3 * MiB, 7 * GiB + 5, 4 * GiB, 900 * MiB][i % 5]
        extents.append((end, size))
        splittable.append(i % 3 != 0)
        end = -(-(end + size) // 64) * 64
    parts = plan_parts(extents, splittable, S3_RULES)
    _check_s3(parts, extents[-1][0] + extents[-1][1])


def test_files_beyond_s3_limits_are_refused_up_front() -> None:
    with pytest.raises(CheckpointError, match=r"does not fit in 10,000 parts of at most "):
        plan_parts([(0, 48 * TiB)], [True], S3_RULES)
