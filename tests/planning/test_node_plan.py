"""The plan of reads shared across nodes: each byte fetched once, by balanced nodes, in rounds."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from unickpt.format.metadata import ChunkMeta, Compression, TensorMeta
from unickpt.layouts.boxes import Box
from unickpt.planning.exchange_plan import Need, RankNeeds
from unickpt.planning.node_plan import NodePlan, plan_node_reads

SEG = 4096
FILE = "data.bin"


def _chunks(sizes: list[int], gap: int = 0) -> dict[str, TensorMeta]:
    """One 1-D float32 tensor per size (in bytes), each one chunk, back to back in one file
    (``gap`` bytes apart)."""
    out, offset = {}, 0
    for i, n in enumerate(sizes):
        segs = max(1, -(-n // SEG))
        chunk = ChunkMeta((0,), (n // 4,), 0, offset, n, ("x",) * segs)
        out[f"t{i}"] = TensorMeta("float32", (n // 4,), "plain", (chunk,))
        offset += n + gap
    return out


def _whole(key: str, meta: TensorMeta) -> Need:
    c = meta.chunks[0]
    return Need(key, FILE, c.byte_offset, c.box, c.nbytes, c.box, c.nbytes, True)


def _replicas(
    tensors: dict[str, TensorMeta], nodes: list[str], source: str | None = "s3://b/c"
) -> list[RankNeeds]:
    """Ranks on ``nodes`` that each load every tensor whole from ``source``."""
    needs = tuple(_whole(k, m) for k, m in tensors.items())
    return [RankNeeds(None, f"t{r}", needs, node, source) for r, node in enumerate(nodes)]


def _plan(
    offers: list[RankNeeds | None],
    tensors: dict[str, TensorMeta],
    unit: int = 16 * SEG,
    rounds: int = 64 * SEG,
) -> NodePlan:
    return plan_node_reads(offers, tensors, [FILE], SEG, unit, rounds)


def _fetched_once(plan: NodePlan, tensors: dict[str, TensorMeta]) -> None:
    """The fetches' units cover every chunk's bytes exactly once."""
    for key, meta in tensors.items():
        c = meta.chunks[0]
        spans = sorted((u.lo, u.hi) for f in plan.fetches for u in f.units if u.key == key)
        assert spans[0][0] == 0 and spans[-1][1] == c.nbytes, key
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), key


def test_replicas_on_four_nodes_read_each_byte_once_spread_over_the_nodes() -> None:
    sizes = [64 * SEG, 48 * SEG, 40 * SEG, 16 * SEG, 8 * SEG, 8 * SEG]  # 184 segments
    tensors = _chunks(sizes)
    offers = _replicas(tensors, ["a", "b", "c", "d"])
    plan = _plan(offers, tensors)
    _fetched_once(plan, tensors)
    # Units of at most 16 segments; each goes from its owner to the three other ranks.
    assert all(f.nbytes <= 16 * SEG and len(f.units) == 1 for f in plan.fetches)
    assert all(sorted((f.owner, *f.receivers)) == [0, 1, 2, 3] for f in plan.fetches)
    # Largest first, each to the least loaded node: no node reads more than its share (46
    # segments) plus one fetch; here ten fetches of 16 segments, then three of 8.
    read = {r: sum(f.nbytes for f in plan.fetches if f.owner == r) for r in range(4)}
    assert sorted(read.values()) == [40 * SEG, 48 * SEG, 48 * SEG, 48 * SEG]
    # Every need of every rank is filled by the plan, and each part is what the rank needs.
    for rank in range(4):
        assert plan.served[rank] == frozenset(range(len(sizes)))
        for i in range(len(sizes)):
            parts = [
                p
                for f in plan.fetches
                for u in f.units
                for p in u.parts
                if (p.rank, p.need) == (rank, i)
            ]
            assert sum(p.box.numel * 4 for p in parts) == sizes[i]
    assert plan.of(2) == list(plan.fetches) and plan.taken(0) == list(plan.fetches)


def test_nodes_not_ranks_are_balanced_and_ranks_of_one_node_share_nothing() -> None:
    tensors = _chunks([16 * SEG] * 6)
    # Two nodes of two ranks: each node reads half, its two ranks a quarter each.
    plan = _plan(_replicas(tensors, ["a", "a", "b", "b"]), tensors)
    read = {r: sum(f.nbytes for f in plan.fetches if f.owner == r) for r in range(4)}
    assert read[0] + read[1] == read[2] + read[3] == 48 * SEG
    assert set(read.values()) == {16 * SEG, 32 * SEG}
    # One node, or no storage shared (files in memory, the option off), or two storages:
    # nothing across nodes.
    assert _plan(_replicas(tensors, ["a", "a", "a"]), tensors).fetches == ()
    offers = _replicas(tensors, ["a", "b"], source=None)
    assert _plan(offers, tensors).fetches == ()
    apart = _replicas(tensors, ["a", "b"])
    apart[1] = dataclasses.replace(apart[1], source="s3://other/c")
    assert _plan(apart, tensors).fetches == ()
    assert _plan([apart[0], None], tensors).fetches == ()


def test_small_chunks_next_to_each_other_go_in_one_fetch() -> None:
    """Small whole chunks needed by the same ranks: one read and one message for several; a
    chunk needed by other ranks, a big one and a compressed one each on their own."""
    tensors = _chunks([256, 192, 64, 512, 16 * SEG, 128, 256], gap=64)
    offers = _replicas(tensors, ["a", "b", "c"])
    # Rank 2 needs only t0..t2 and t4: t3 is needed by other ranks than its neighbours.
    offers[2] = dataclasses.replace(offers[2], needs=offers[2].needs[:3] + offers[2].needs[4:5])
    plan = _plan(offers, tensors)
    _fetched_once(plan, tensors)
    keys = sorted(tuple(u.key for u in f.units) for f in plan.fetches)
    assert keys == [("t0", "t1", "t2"), ("t3",), ("t4",), ("t5", "t6")]
    first = next(f for f in plan.fetches if len(f.units) == 3)
    c = [tensors[k].chunks[0] for k in ("t0", "t1", "t2")]
    assert (first.start, first.stop) == (c[0].byte_offset, c[2].byte_offset + c[2].nbytes)
    assert [u.offset for u in first.units] == [x.byte_offset - c[0].byte_offset for x in c]
    assert next(f for f in plan.fetches if f.units[0].key == "t3").receivers != ()
    assert 2 not in {
        r for f in plan.fetches if f.units[0].key == "t3" for r in (f.owner, *f.receivers)
    }
    # Compressed chunks move alone, as their stored segments.
    packed = {k: _compressed(m) for k, m in tensors.items()}
    offers = [
        dataclasses.replace(o, needs=tuple(_as_compressed(n) for n in o.needs))
        for o in _replicas(packed, ["a", "b"])
    ]
    plan = _plan(offers, packed)
    assert len(plan.fetches) == len(packed)
    assert all(len(f.units) == 1 and f.compressed for f in plan.fetches)


def _compressed(meta: TensorMeta) -> TensorMeta:
    c = meta.chunks[0]
    stored = Compression("zstd", 4, (c.nbytes // 2,))
    return dataclasses.replace(meta, chunks=(dataclasses.replace(c, compression=stored),))


def _as_compressed(need: Need) -> Need:
    return dataclasses.replace(need, direct=False, compressed=True, host=False)


def test_rounds_bound_each_rank_bytes_and_follow_the_file() -> None:
    tensors = _chunks([16 * SEG] * 10)
    offers = _replicas(tensors, ["a", "b", "c"])
    plan = _plan(offers, tensors, rounds=48 * SEG)
    assert plan.rounds == 4  # every rank takes part in every fetch: three per round
    for rank, rnd in itertools.product(range(3), range(plan.rounds)):
        moved = sum(f.nbytes for f in plan.fetches if f.round == rnd and f.takes_part(rank))
        assert moved <= 48 * SEG
    for rank in range(3):  # each rank's rounds follow the file
        rounds = [f.round for f in plan.fetches if f.takes_part(rank)]
        assert rounds == sorted(rounds)
    # A fetch larger than a round goes alone.
    plan = _plan(offers, tensors, rounds=4 * SEG)
    assert plan.rounds == 10 and [f.round for f in plan.fetches] == list(range(10))


def _row_sharded(rows: int, cols: int) -> TensorMeta:
    half = rows // 2
    size = half * cols * 4
    chunks = tuple(
        ChunkMeta((r * half, 0), (half, cols), 0, r * size, size, ("x",) * (size // SEG))
        for r in range(2)
    )
    return TensorMeta("float32", (rows, cols), "dtensor", chunks)


def _col_needs(meta: TensorMeta, rank: int, of: int) -> tuple[Need, ...]:
    """Rank ``rank``'s column slice (of ``of``) of every saved chunk: a Shard(1) destination."""
    cols = meta.shape[1]
    return tuple(
        Need(
            "w",
            FILE,
            c.byte_offset,
            Box((c.offsets[0], rank * cols // of), (c.lengths[0], cols // of)),
            c.nbytes,
            c.box,
            c.nbytes,
            False,
            False,
            True,
        )
        for c in meta.chunks
    )


def test_a_resharded_load_on_two_nodes_reads_each_chunk_once() -> None:
    """Shard(0) saved, Shard(1) loaded by four ranks on two nodes: every rank needs a quarter
    of every row; each chunk is read once and each rank gets exactly its parts."""
    meta = _row_sharded(256, 384)
    tensors = {"w": meta}
    offers = [
        RankNeeds(None, f"t{r}", _col_needs(meta, r, 4), "ab"[r // 2], "/ckpt") for r in range(4)
    ]
    plan = _plan(offers, tensors)
    for chunk in meta.chunks:
        spans = sorted((u.lo, u.hi) for f in plan.fetches for u in f.units if u.chunk == chunk)
        assert spans[0][0] == 0 and spans[-1][1] == chunk.nbytes
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    for rank, offer in enumerate(offers):
        for i, need in enumerate(offer.needs):
            parts = [
                p.box
                for f in plan.fetches
                for u in f.units
                for p in u.parts
                if (p.rank, p.need) == (rank, i)
            ]
            assert sum(b.numel for b in parts) == need.region.numel
            assert all(b.intersect(need.region) == b for b in parts)
            assert all(a.intersect(b) is None for a, b in itertools.combinations(parts, 2))
    # Ranks that have not read a chunk's index plan it alike, from the needs' geometry.
    blind = _plan(offers, {"w": dataclasses.replace(meta, chunks=())})
    strip = [
        dataclasses.replace(f, units=tuple(dataclasses.replace(u, chunk=None) for u in f.units))
        for f in plan.fetches
    ]
    assert strip == [
        dataclasses.replace(f, units=tuple(dataclasses.replace(u, chunk=None) for u in f.units))
        for f in blind.fetches
    ]
    with pytest.raises(AssertionError, match="rank 0 takes part in a fetch of 'w'"):
        blind.taken(0)
