"""The exchange plan: units that cover what ranks of one host need, read once, owners balanced."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from unickpt.format.metadata import ChunkMeta, TensorMeta
from unickpt.layouts.boxes import Box
from unickpt.planning.exchange_plan import (
    ExchangePlan,
    Need,
    RankNeeds,
    flat_span,
    plan_exchange,
)

SEG = 4096
FILES = ("r0.data", "r1.data")


def _row_sharded(rows: int, cols: int) -> TensorMeta:
    """A float32 tensor saved as two row halves, one per file, 4 bytes per element."""
    half = rows // 2
    chunks = tuple(
        ChunkMeta((r * half, 0), (half, cols), r, 0, half * cols * 4, ("x",)) for r in range(2)
    )
    return TensorMeta("float32", (rows, cols), "dtensor", chunks)


def _col_needs(meta: TensorMeta, rank: int, key: str = "w") -> tuple[Need, ...]:
    """Rank ``rank``'s column half of every saved chunk (a Shard(1) destination)."""
    _rows, cols = meta.shape
    out = []
    for c in meta.chunks:
        region = Box((c.offsets[0], rank * cols // 2), (c.lengths[0], cols // 2))
        out.append(Need(key, FILES[c.file], c.byte_offset, region, c.nbytes, c.box, c.nbytes))
    return tuple(out)


def _covered_once(plan: ExchangePlan, needs: dict[int, tuple[Need, ...]]) -> None:
    """Every need's region is the disjoint union of its parts."""
    for rank, rank_needs in needs.items():
        for i, need in enumerate(rank_needs):
            parts = [p.box for u in plan.units for p in u.parts if (p.rank, p.need) == (rank, i)]
            assert sum(b.numel for b in parts) == need.region.numel
            for j, a in enumerate(parts):
                assert a.intersect(need.region) == a
                assert all(a.intersect(b) is None for b in parts[j + 1 :])


def test_column_halves_of_row_chunks_are_read_once_by_balanced_owners() -> None:
    meta = _row_sharded(512, 768)  # chunks of 768 KiB; units of 64 KiB
    needs = {r: _col_needs(meta, r) for r in range(2)}
    offers = [RankNeeds("host", f"t{r}", needs[r]) for r in range(2)]
    plan = plan_exchange(offers, {"w": meta}, FILES, SEG, 16 * SEG, 64 * SEG)
    for chunk in meta.chunks:
        spans = sorted((u.lo, u.hi) for u in plan.units if u.chunk == chunk)
        assert spans[0][0] == 0 and spans[-1][1] == chunk.nbytes
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no byte read twice
        assert all(hi - lo <= 16 * SEG and lo % SEG == 0 for lo, hi in spans)
    read = {r: sum(u.hi - u.lo for u in plan.units if u.owner == r) for r in range(2)}
    assert read[0] == read[1] == meta.chunks[0].nbytes
    _covered_once(plan, needs)
    assert plan.exchanged(0) == plan.exchanged(1) == frozenset({0, 1})
    assert plan.tokens == {0: "t0", 1: "t1"}
    # Rounds: each owner's buffer holds at most 64 KiB * 4 per round, units laid end to end.
    assert plan.rounds == 3 and set(plan.buffer_bytes.values()) == {64 * SEG}
    for r in range(2):
        for rnd in range(plan.rounds):
            mine = sorted(
                (u.offset, u.hi - u.lo) for u in plan.units if (u.owner, u.round) == (r, rnd)
            )
            assert [o for o, _ in mine] == [sum(n for _, n in mine[:i]) for i in range(len(mine))]


def test_nothing_is_exchanged_between_hosts_or_without_a_group() -> None:
    meta = _row_sharded(64, 64)
    tensors = {"w": meta}
    for groups in (("a", "b"), (None, None), ("a", None)):
        offers = [RankNeeds(g, f"t{r}", _col_needs(meta, r)) for r, g in enumerate(groups)]
        assert plan_exchange(offers, tensors, FILES, SEG, SEG, SEG).units == ()
    # A single process, or a rank that needs nothing partial.
    one = [RankNeeds("a", "t0", _col_needs(meta, 0))]
    assert plan_exchange(one, tensors, FILES, SEG, SEG, SEG).units == ()
    assert plan_exchange([one[0], None], tensors, FILES, SEG, SEG, SEG).units == ()


def test_a_chunk_is_exchanged_only_when_that_reads_fewer_bytes() -> None:
    meta = _row_sharded(64, 64)  # chunks of 8 KiB: two segments
    chunk = meta.chunks[0]
    # Both ranks need the first row only: reading alone costs a segment each; the exchange would
    # read one segment once, so it is used.
    row = Box((0, 0), (1, 32))
    needs = [
        Need("w", FILES[0], 0, Box((0, 32 * r), (1, 32)), SEG, chunk.box, chunk.nbytes)
        for r in range(2)
    ]
    offers = [RankNeeds("h", f"t{r}", (needs[r],)) for r in range(2)]
    plan = plan_exchange(offers, {"w": meta}, FILES, SEG, SEG, SEG)
    assert [(u.lo, u.hi) for u in plan.units] == [(0, SEG)]
    # Reading alone costs what the exchange would read: nothing is gained, each reads alone.
    cheap = [Need("w", FILES[0], 0, row, 64, chunk.box, chunk.nbytes) for _ in range(2)]
    offers = [RankNeeds("h", f"t{r}", (cheap[r],)) for r in range(2)]
    assert plan_exchange(offers, {"w": meta}, FILES, SEG, SEG, SEG).units == ()
    assert flat_span(chunk, Box((1, 3), (2, 4))) == (67, 64 * 2 + 7)


def test_ranks_that_read_no_part_of_a_chunk_plan_its_units_alike() -> None:
    """The ranks of another host, and ranks that need none of a chunk, have not read its index:
    they plan its units from the geometry the needs carry, and the plan is the same as where
    the chunk is known (owners, rounds, buffers), so collectives and owners agree."""
    meta = _row_sharded(512, 768)
    offers = [RankNeeds("host", f"t{r}", _col_needs(meta, r)) for r in range(2)]
    offers += [RankNeeds("other", f"t{r}", _col_needs(meta, r - 2)) for r in (2, 3)]
    known = plan_exchange(offers, {"w": meta}, FILES, SEG, 16 * SEG, 64 * SEG)
    unread = dataclasses.replace(meta, chunks=())
    blind = plan_exchange(offers, {"w": unread}, FILES, SEG, 16 * SEG, 64 * SEG)
    strip = [dataclasses.replace(u, chunk=None) for u in known.units]
    assert strip == [dataclasses.replace(u, chunk=None) for u in blind.units]
    assert (known.rounds, known.buffer_bytes) == (blind.rounds, blind.buffer_bytes)
    assert {(u.chunk.offsets, u.chunk.lengths, u.chunk.nbytes) for u in blind.units} == {
        (c.offsets, c.lengths, c.nbytes) for c in meta.chunks
    }
    assert all(u.chunk.checksums == ("x",) for u in known.taken(0))
    # A rank whose plan has a unit it takes part in, but not its chunk, refuses to go on: it
    # would lack the chunk's checksums.
    with pytest.raises(AssertionError, match="rank 0 takes part in a unit of 'w'"):
        blind.taken(0)
