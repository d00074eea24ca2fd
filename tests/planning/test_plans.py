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


def test_ranks_disagreeing_are_named() -> None:
    a = _plan({"x": TensorDecl("float32", (2,), "replicated", (Box((0,), (2,)),))})
    b = _plan({})
    with pytest.raises(CheckpointMismatchError, match="rank 1 lacks 'x'"):
        build_global_plan([a, b])
    c = _plan({"x": TensorDecl("float16", (2,), "replicated", (Box((0,), (2,)),))})
    with pytest.raises(CheckpointMismatchError, match="on rank 1"):
        build_global_plan([a, c])


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
