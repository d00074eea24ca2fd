from __future__ import annotations

import numpy as np
import pytest
import torch

from unickpt import CheckpointCorruptError, CheckpointMismatchError
from unickpt.bench.restore_plan import restore_figures
from unickpt.format.metadata import ChunkMeta, TensorMeta
from unickpt.layouts.boxes import Box
from unickpt.planning.load_plan import ChunkIndex, plan_reads
from unickpt.planning.save_plan import LocalPlan, TensorDecl, build_global_plan, rank_loads
from unickpt.planning.simulate import simulate_save


def _plan(tensors: dict[str, TensorDecl]) -> LocalPlan:
    return LocalPlan(tensors, (), ())


def test_replicas_written_once_and_spread() -> None:
    decl = {
        f"t{i}": TensorDecl("float32", (100,), "replicated", (Box((0,), (100,)),)) for i in range(8)
    }
    plan = build_global_plan([_plan(decl) for _ in range(4)])
    counts = [len(plan.writes(r)) for r in range(4)]
    assert counts == [2, 2, 2, 2]
    assert sorted(i.key for r in range(4) for i in plan.writes(r)) == sorted(decl)


def _decl(shape: tuple[int, ...], *boxes: Box, dtype: str = "float32", layout: str = "sharded"):
    return TensorDecl(dtype, shape, layout, boxes)


def test_keys_held_by_some_ranks_are_written_by_them() -> None:
    whole = Box((0,), (4,))
    stage0 = LocalPlan(
        {"layers.0.w": _decl((4,), whole, layout="replicated"), "norm": _decl((4,), whole)},
        ("train.step", "loader.dp_rank_0"),
        ("rng",),
    )
    stage1 = LocalPlan(
        {"layers.1.w": _decl((4,), whole, layout="replicated"), "norm": _decl((4,), whole)},
        ("loader.dp_rank_1", "train.step"),
        ("rng", "extra"),
    )
    plan = build_global_plan([stage0, stage0, stage1])
    written = {r: [i.key for i in plan.writes(r)] for r in range(3)}
    assert sorted(k for keys in written.values() for k in keys) == [
        "layers.0.w",
        "layers.1.w",
        "norm",
    ]
    assert "layers.1.w" in written[2] and "layers.0.w" not in written[2]
    assert plan.value_writers == {"loader.dp_rank_0": 0, "train.step": 0, "loader.dp_rank_1": 2}
    assert plan.values_of(2) == ["loader.dp_rank_1"] and plan.values_of(1) == []
    assert plan.per_rank_keys == ("extra", "rng")


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (
            _decl((3,), Box((0,), (3,))),
            r"'x' is a ShardedTensor block float32\[3\] on rank 1 but a "
            r"ShardedTensor block float32\[2\] on rank 0",
        ),
        (
            _decl((2,), Box((0,), (2,)), dtype="float16"),
            r"float16\[2\] on rank 1 but a "
            r"ShardedTensor block float32\[2\]",
        ),
        (
            _decl((2,), Box((0,), (2,)), layout="replicated"),
            r"'x' is a plain tensor float32\[2\] "
            r"on rank 1 but a ShardedTensor block",
        ),
    ],
)
def test_ranks_disagreeing_on_a_tensor_are_named(other: TensorDecl, message: str) -> None:
    a = _plan({"x": _decl((2,), Box((0,), (2,)))})
    with pytest.raises(CheckpointMismatchError, match=message):
        build_global_plan([a, _plan({"x": other})])


def test_a_key_of_different_kinds_is_refused() -> None:
    tensor = _plan({"x": _decl((2,), Box((0,), (2,)))})
    value = LocalPlan({}, ("x",), ())
    per_rank = LocalPlan({}, (), ("x",))
    with pytest.raises(
        CheckpointMismatchError, match="'x' is a plain value on rank 1 but a tensor"
    ):
        build_global_plan([tensor, value])
    with pytest.raises(
        CheckpointMismatchError, match=r"a plain value on rank 0 but a unickpt\.PerRank"
    ):
        build_global_plan([value, per_rank])


@pytest.mark.parametrize(
    ("boxes", "region"),
    [
        ([Box((0,), (5,)), Box((3,), (5,))], "elements \\[3:5\\] are held by more than one shard"),
        ([Box((0,), (5,)), Box((6,), (4,))], "elements \\[5:6\\] are held by no shard"),
    ],
)
def test_overlaps_and_gaps_are_refused_with_the_region(boxes: list[Box], region: str) -> None:
    plans = [_plan({"w": _decl((10,), b)}) for b in boxes]
    with pytest.raises(CheckpointMismatchError, match=f"the shards of 'w' .*{region}"):
        build_global_plan(plans)


def test_tied_keys_are_saved_once() -> None:
    whole = Box((0, 0), (3, 2))
    tied = LocalPlan({"wte": _decl((3, 2), whole, layout="replicated")}, (), (), {"head": "wte"})
    plan = build_global_plan([tied, tied])
    assert plan.aliases == {"head": "wte"}
    assert [i.key for r in range(2) for i in plan.writes(r)] == ["wte"]
    untied = _plan({"wte": _decl((3, 2), whole, layout="replicated"), "head": _decl((3, 2), whole)})
    with pytest.raises(CheckpointMismatchError, match="'head' is tied to 'wte' on rank 0"):
        build_global_plan([tied, untied])


def test_index_looks_only_at_overlapping_chunks() -> None:
    chunks = tuple(ChunkMeta((i * 10, 0), (10, 8), 0, i * 320, 320) for i in range(1000))
    index = ChunkIndex(chunks)
    found = index.overlapping(Box((4995, 0), (10, 8)))
    assert [c.offsets for c, _ in found] == [(4990, 0), (5000, 0)]
    meta = TensorMeta("float32", (10000, 8), "dtensor", chunks)
    dest = torch.empty(10, 8)
    items = plan_reads("w", meta, ("f",), [(Box((4995, 0), (10, 8)), dest)], index)
    assert [i.region for i in items] == [Box((4995, 0), (5, 8)), Box((5000, 0), (5, 8))]
    # Chunks that leave part of a piece unheld (here the index knows only the first) are
    # refused: the rest would stay unread, holding whatever the destination held.
    partial = ChunkIndex(chunks[499:500])
    with pytest.raises(
        CheckpointCorruptError, match=r"'w': the saved chunks found hold 40 of the 80"
    ):
        plan_reads("w", meta, ("f",), [(Box((4995, 0), (10, 8)), dest)], partial)


def test_simulation_reports_costs() -> None:
    save = simulate_save(ranks=64, tensors=40, tp=8)
    report = save.report
    assert report["chunks"] == 64 * 40
    assert report["cached_save_exchange_bytes_per_rank"] == 40  # five int64, all-reduced
    assert report["global_metadata_bytes"] < report["index_bytes_total_est"]
    # The last of 64 loading ranks (16 x TP 4) holds the last 1/16 of the rows (within the
    # last of 8 saved row blocks) and the last quarter of the columns (2 of 8 saved blocks):
    # it reads the indexes of those 2 saving ranks only.
    restore = restore_figures(save, 4)
    assert restore["restore_reads_per_rank"] == 40 * 2
    assert restore["restore_index_files_read"] == 2


def test_replica_groups_each_write_a_share() -> None:
    """HSDP: 2 replica groups of 3 shards each; every shard once, by one of its 2 holders,
    each rank writing half of what it holds (the groups are decided at once)."""
    plans = []
    for rank in range(6):
        shard = rank % 3
        tensors = {
            f"t{i}": _decl((6, 4), Box((2 * shard, 0), (2, 4)), layout="dtensor") for i in range(4)
        }
        plans.append(_plan(tensors))
    plan = build_global_plan(plans)
    written = [[(i.key, i.box.offsets) for i in plan.writes(r)] for r in range(6)]
    every = sorted(x for w in written for x in w)
    assert every == sorted((f"t{i}", (2 * s, 0)) for i in range(4) for s in range(3))
    for rank, items in enumerate(written):
        assert all(offsets == (2 * (rank % 3), 0) for _, offsets in items)
    assert [len(w) for w in written] == [2] * 6
    assert rank_loads(plan) == [2 * 8 * 4] * 6


def test_overlapping_holders_are_decided_one_by_one() -> None:
    """Boxes of one tensor whose holder sets overlap: largest first to the least-loaded."""
    a = _plan({"w": _decl((10,), Box((0,), (6,)), Box((6,), (4,)))})
    b = _plan({"w": _decl((10,), Box((0,), (6,)), Box((6,), (4,)))})
    plan = build_global_plan([a, b])
    assert [[i.box for i in plan.writes(r)] for r in range(2)] == [
        [Box((0,), (6,))],
        [Box((6,), (4,))],
    ]


def test_tensors_of_any_rank_and_dimensions_pack_together() -> None:
    """Ranks of different dimensions (a scalar, a vector, a 3-d block) plan as one."""
    scalar = _decl((), Box((), ()), layout="replicated")
    first = _plan({"s": scalar, "v": _decl((4,), Box((0,), (4,)), layout="replicated")})
    second = _plan({"s": scalar, "b": _decl((2, 2, 3), Box((0, 0, 0), (2, 2, 3)))})
    packed = second.packed()
    assert packed.dims == 3 and packed.coords.tolist() == [
        [0, 0, 0, 1, 1, 1],
        [0, 0, 0, 2, 2, 3],
    ]
    plan = build_global_plan([first, second.packed()])
    written = {i.key: (r, i.box) for r in range(2) for i in plan.writes(r)}
    assert written == {
        "s": (0, Box((), ())),
        "v": (0, Box((0,), (4,))),
        "b": (1, Box((0, 0, 0), (2, 2, 3))),
    }
    assert plan.chunks == 3
    assert first.packed().signature() == first.packed().signature() != packed.signature()


def test_scalars_only_on_every_rank() -> None:
    scalar = _decl((), Box((), ()), layout="replicated")
    plan = build_global_plan([_plan({"a": scalar, "b": scalar}) for _ in range(3)])
    assert sorted((i.key, r) for r in range(3) for i in plan.writes(r)) == [("a", 0), ("b", 1)]


def test_large_replicas_are_written_in_shares_by_their_holders() -> None:
    """A box 4 ranks hold, of at least twice ``share_bytes``: 4 shares of rows, one per
    holder; a small one stays whole; every element is written once."""
    big = _decl((10, 400), Box((0, 0), (10, 400)), layout="replicated")  # 16,000 bytes
    small = _decl((3,), Box((0,), (3,)), layout="replicated")
    plan = build_global_plan([_plan({"big": big, "small": small}) for _ in range(4)], 2000)
    shares = sorted((i.box, r, i.held) for r in range(4) for i in plan.writes(r) if i.key == "big")
    assert [(box.offsets, box.lengths, r) for box, r, _ in shares] == [
        ((0, 0), (3, 400), 0),
        ((3, 0), (3, 400), 1),
        ((6, 0), (2, 400), 2),
        ((8, 0), (2, 400), 3),
    ]
    assert all(held == big.boxes[0] for *_, held in shares)
    assert [i.key for r in range(4) for i in plan.writes(r)].count("small") == 1
    assert plan.chunks == 5
    # Whole, as before, where shares are off.
    whole = build_global_plan([_plan({"big": big}) for _ in range(4)])
    assert [i.box for r in range(4) for i in whole.writes(r)] == [big.boxes[0]]


def test_fewer_shares_than_holders_take_turns() -> None:
    """Boxes of 2 shares (too small for 4) held by 4 ranks: the tensors of a layout, then the
    next layout, take turns among the holders; a box of 2 rows is cut in 2 at most."""
    decl = _decl((8, 100), Box((0, 0), (8, 100)), layout="replicated")  # 3,200 bytes
    tall = _decl((2, 1000), Box((0, 0), (2, 1000)), layout="replicated")  # 8,000 bytes
    tensors = {f"t{i}": decl for i in range(3)} | {"tall": tall}
    plan = build_global_plan([_plan(tensors) for _ in range(4)], 1600)
    writers = {(i.key, i.box.offsets): r for r in range(4) for i in plan.writes(r)}
    assert writers == {
        **{(f"t{j}", (4 * s, 0)): (2 * j + s) % 4 for j in range(3) for s in range(2)},
        ("tall", (0, 0)): 2,
        ("tall", (1, 0)): 3,
    }
    assert rank_loads(plan) == [3200, 3200, 1600 + 4000, 1600 + 4000]


def test_shares_of_replica_groups_and_their_chunk_map() -> None:
    """HSDP: 2 replica groups of 2 shards; each shard is cut in 2 rows, one per replica."""
    plans = [
        _plan({"w": _decl((8, 4), Box((4 * (r % 2), 0), (4, 4)), layout="dtensor")})
        for r in range(4)
    ]
    plan = build_global_plan(plans, 32)
    written = sorted((i.box.offsets, i.box.lengths, r) for r in range(4) for i in plan.writes(r))
    assert written == [
        ((0, 0), (2, 4), 0),
        ((2, 0), (2, 4), 2),
        ((4, 0), (2, 4), 1),
        ((6, 0), (2, 4), 3),
    ]
    lay = plan.chunk_map(np.arange(4)).layout("w")
    assert lay is not None
    assert sorted(zip(lay.coords[:, 0].tolist(), lay.files.tolist())) == [
        (0, 0),
        (2, 2),
        (4, 1),
        (6, 3),
    ]
