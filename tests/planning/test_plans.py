from __future__ import annotations

import pytest
import torch

from unickpt import CheckpointMismatchError
from unickpt.format.metadata import ChunkMeta, TensorMeta
from unickpt.layouts.boxes import Box
from unickpt.planning.load_plan import ChunkIndex, plan_reads
from unickpt.planning.save_plan import LocalPlan, TensorDecl, build_global_plan
from unickpt.planning.simulate import simulate_fsdp_tp


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


def test_simulation_reports_costs() -> None:
    report = simulate_fsdp_tp(ranks=64, tensors=40, tp=8)
    assert report["chunks"] == 64 * 40
    assert report["cached_save_exchange_bytes_per_rank"] == 32
    assert report["global_metadata_bytes"] < report["index_bytes_total"]
