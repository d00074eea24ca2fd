"""Pipeline, expert and TP-inside-FSDP2 states: saved on some ranks, loaded on others.

Ranks hold different keys (pipeline stages, experts, per-rank loader states); each rank asks
only for its own keys, from any save world size, and every loaded leaf is compared bit for bit
with what that rank should hold. Two save runs (4 and 2 ranks) and one load run per world size
check all cases.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import unickpt
from tests.api import parallel_zoo as zoo
from tests.distributed import run_ranks
from unickpt.planning.flatten import tensor_leaf

# (pipeline stages, tensor-parallel ranks) loaded on each world size; saved as 2 x 2.
MEGATRON_LOADS = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 3: [(3, 1)], 4: [(4, 1), (2, 2)]}
# (data-parallel, tensor-parallel) of the MLP loaded on each world size; saved as 2 x 2.
FSDP_LOADS = {1: (1, 1), 2: (2, 1), 4: (2, 2)}


def _attempt(fn: Callable[[], Any]) -> tuple[str, str, list[str]]:
    """(error class or "ok", message, warnings) of a call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the outcome is what the tests check
            return type(e).__name__, str(e), [str(w.message) for w in caught]
    return "ok", "", [str(w.message) for w in caught]


def _boxes_match_full_tensor(key: str, dt: DTensor, full: Any = None) -> bool:
    """Each box computed for this rank's local shard holds those elements of the whole."""
    full = dt.full_tensor() if full is None else full
    pieces = tensor_leaf(key, dt).pieces
    held = sum(b.numel for b, _ in pieces)
    return held == dt.to_local().numel() and all(
        torch.equal(view, full[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))])
        for b, view in pieces
    )


def _strided(world: int) -> Any:
    """10 rows in two halves, each cut into ``world`` parts: rank 0 holds rows 0-1 and 5-6."""
    full = zoo.value_of("strided", (10, 3))
    m = zoo.mesh((world,), ("x",))
    return distribute_tensor(full, m, [_StridedShard(0, split_factor=2)], src_data_rank=None)


def _save_four(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    unickpt.save(f"{root}/megatron", zoo.megatron(rank, 2, 2))
    model, opt = zoo.tp_in_fsdp2(2, 2, seed=0)
    zoo.train_step(model, opt, rank, 2, 2)
    unickpt.save(f"{root}/fsdp", {"model": model, "optim": opt})
    reference = zoo.full_state(model, opt)
    if rank == 0:
        torch.save(reference, f"{root}/fsdp-reference.pt")
    dtensors = {n: p for n, p in model.named_parameters()}
    dtensors.update({f"{n}.exp_avg": opt.state[p]["exp_avg"] for n, p in model.named_parameters()})
    out["placements"] = sorted({str(t.placements) for t in dtensors.values()})
    out["boxes wrong"] = [k for k, t in dtensors.items() if not _boxes_match_full_tensor(k, t)]
    strided = _strided(world)
    out["strided pieces"] = len(tensor_leaf("s", strided).pieces)
    full = zoo.value_of("strided", (10, 3))
    out["strided boxes right"] = _boxes_match_full_tensor("s", strided, full)
    unickpt.save(f"{root}/strided", {"s": strided})
    return out


def _per_rank_state(rank: int, seed: int, error: bool = False) -> dict[str, Any]:
    torch.manual_seed(seed)
    how = "error" if error else "warn"
    return {
        "rng": unickpt.PerRank(torch.get_rng_state()),
        "data": unickpt.PerRank({"pos": seed}, on_world_change=how),
    }


def _save_two(rank: int, world: int, root: str) -> dict[str, Any]:
    unickpt.save(f"{root}/experts", zoo.experts(rank, world, 4))
    state: dict[str, Any] = {
        **_per_rank_state(rank, 100 + rank),
        "loader": {f"dp_rank_{rank}": {"pos": 500 + rank}},
    }
    if rank == 1:
        state["late"] = unickpt.PerRank("rank 1 only")
    unickpt.save(f"{root}/per-rank", state)
    return {"rng sample": torch.rand(3).tolist()}


def _load_megatron(rank: int, world: int, root: str, out: dict[str, Any]) -> None:
    for pp, tp in MEGATRON_LOADS[world]:
        dest = zoo.megatron(rank, pp, tp, blank=True)
        unickpt.load(f"{root}/megatron", dest)
        out[f"megatron {pp}x{tp}"] = zoo.differences(dest, zoo.megatron(rank, pp, tp))


def _load_experts(rank: int, world: int, root: str, out: dict[str, Any]) -> None:
    per = 8 // world
    dest = zoo.experts(rank, world, per, blank=True)
    unickpt.load(f"{root}/experts", dest)
    out["experts"] = zoo.differences(dest, zoo.experts(rank, world, per))
    if world != 4:
        return
    one = zoo.experts(rank, world, 1, blank=True)
    out["experts 1 per rank, strict"] = _attempt(lambda: unickpt.load(f"{root}/experts", one))
    report: list[Any] = []
    out["experts 1 per rank"] = _attempt(
        lambda: report.append(unickpt.load(f"{root}/experts", one, strict=False))
    )
    out["experts 1 per rank: wrong"] = zoo.differences(one, zoo.experts(rank, world, 1))
    out["experts 1 per rank: unread"] = report[0].unread_keys


def _load_per_rank(rank: int, world: int, root: str, out: dict[str, Any]) -> None:
    state = _per_rank_state(rank, 7)
    if world == 2:
        state["loader"] = {f"dp_rank_{rank}": {"pos": -1}}
        state["late"] = unickpt.PerRank("mine")
    out["per-rank"] = _attempt(lambda: unickpt.load(f"{root}/per-rank", state))
    out["per-rank: data"] = state["data"].value
    out["per-rank: loader"] = state.get("loader")
    out["per-rank: late"] = state["late"].value if "late" in state else None
    torch.set_rng_state(state["rng"].value)
    out["rng sample"] = torch.rand(3).tolist()
    strict = _per_rank_state(rank, 7, error=True)
    out["per-rank refused"] = _attempt(lambda: unickpt.load(f"{root}/per-rank", strict))


def _load_fsdp(rank: int, world: int, root: str, out: dict[str, Any]) -> None:
    dp, tp = FSDP_LOADS[world]
    model, opt = zoo.tp_in_fsdp2(dp, tp, seed=99)
    unickpt.load(f"{root}/fsdp", {"model": model, "optim": opt})
    got = zoo.full_state(model, opt)
    want = torch.load(f"{root}/fsdp-reference.pt")
    out["fsdp"] = sorted(k for k in want if k not in got or not torch.equal(got[k], want[k]))
    full = zoo.value_of("strided", (10, 3))
    if world == 1:
        dest: Any = torch.zeros(10, 3)
    elif world == 2:
        dest = distribute_tensor(torch.zeros(10, 3), zoo.mesh((2,), ("x",)), [Shard(0)])
    else:
        dest = _strided(world)
        zoo.local_of(dest).fill_(-7)
    unickpt.load(f"{root}/strided", {"s": dest})
    expected = (
        _strided(world) if world == 4 else full if world == 1 else full[5 * rank : 5 * rank + 5]
    )
    out["strided"] = torch.equal(zoo.local_of(dest), zoo.local_of(expected))


def _load(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _load_megatron(rank, world, root, out)
    if world in (1, 2, 4):
        _load_experts(rank, world, root, out)
        _load_per_rank(rank, world, root, out)
        _load_fsdp(rank, world, root, out)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Any], list[Any]]:
    root = str(tmp_path_factory.mktemp("parallel"))
    four = run_ranks(4, _save_four, root)
    two = run_ranks(2, _save_two, root)
    return root, four, two


@pytest.fixture(scope="module")
def loaded(saved: Any) -> Callable[[int], list[dict[str, Any]]]:
    """The outcomes of each rank of a load run on ``world`` ranks (run once per world size)."""
    runs: dict[int, list[dict[str, Any]]] = {}

    def on(world: int) -> list[dict[str, Any]]:
        if world not in runs:
            runs[world] = run_ranks(world, _load, saved[0])
        return runs[world]

    return on


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_megatron_pp_tp_state_loads_into_every_reshape(loaded: Any, world: int) -> None:
    results = loaded(world)
    for pp, tp in MEGATRON_LOADS[world]:
        assert [r[f"megatron {pp}x{tp}"] for r in results] == [[]] * world, (pp, tp)


def test_megatron_stages_write_only_their_keys(saved: Any) -> None:
    from unickpt.engine.commit import read_checkpoint
    from unickpt.storage import LocalStorage

    _, meta = read_checkpoint(LocalStorage(f"{saved[0]}/megatron"))
    assert meta.objects["model.head.vocab"] == {"$tuple": [zoo.VOCAB, 16]}
    layer0 = meta.tensors["model.layers.0.norm.weight"]
    assert [c.file for c in layer0.chunks] in ([0], [1])  # a replica of stage 0, written once
    head = meta.tensors["model.head.weight"]
    assert sorted(c.file for c in head.chunks) == [2, 3]
    assert sum(c.nbytes for c in head.chunks) == zoo.VOCAB * zoo.HIDDEN * 4


@pytest.mark.parametrize("world", [1, 2, 4])
def test_experts_regroup(loaded: Any, world: int) -> None:
    results = loaded(world)
    assert [r["experts"] for r in results] == [[]] * world


def test_experts_nobody_asks_for_are_refused_or_reported(loaded: Any) -> None:
    for r in loaded(4):
        kind, message, _ = r["experts 1 per rank, strict"]
        assert kind == "CheckpointMismatchError"
        assert "planning the load failed on 4 of 4 ranks:\n  ranks 0, 1, 2, 3: " in message
        assert (
            "the checkpoint has keys that no rank's state asks for: 'moe.experts.4.tokens_seen', "
            "'moe.experts.4.w1', 'moe.experts.5.tokens_seen'" in message
        )
        assert "(4 tensors (384 B), 4 values)" in message
        kind, _, caught = r["experts 1 per rank"]
        assert kind == "ok"
        assert caught == [
            "strict=False: 'moe': 4 tensors (384 B), 4 values not loaded (not in any rank's "
            "state): 'moe.experts.4.tokens_seen', 'moe.experts.4.w1', "
            "'moe.experts.5.tokens_seen' and 5 more"
        ]
        assert r["experts 1 per rank: wrong"] == []
        assert len(r["experts 1 per rank: unread"]) == 8


@pytest.mark.parametrize("world", [1, 2, 4])
def test_per_rank_values_survive_a_world_size_change(saved: Any, loaded: Any, world: int) -> None:
    results = loaded(world)
    samples = [s["rng sample"] for s in saved[2]]
    for rank, r in enumerate(results):
        kind, message, caught = r["per-rank"]
        assert kind == "ok", message
        if rank < 2:
            assert r["per-rank: data"] == {"pos": 100 + rank}
            assert r["rng sample"] == samples[rank]
        else:
            assert r["per-rank: data"] == {"pos": 7}
        if world == 2:
            assert r["per-rank: loader"] == {f"dp_rank_{rank}": {"pos": 500 + rank}}
            assert r["per-rank: late"] == ("mine" if rank == 0 else "rank 1 only")
            assert caught == [
                "'late': it was saved by 2 ranks (rank 1 holding a value) and 2 ranks are "
                "loading; ranks with a saved value get it back, the others keep their current "
                "value (PerRank(..., on_world_change='error') refuses such a load)."
            ] * (rank == 0)
        else:
            assert sorted(caught) == [
                f"'{key}': it was saved by 2 ranks (ranks 0, 1 holding a value) and {world} "
                "ranks are loading; ranks with a saved value get it back, the others keep their "
                "current value (PerRank(..., on_world_change='error') refuses such a load)."
                for key in ("data", "rng")
            ]


@pytest.mark.parametrize("world", [1, 4])
def test_per_rank_value_can_refuse_a_world_size_change(loaded: Any, world: int) -> None:
    for r in loaded(world):
        kind, message, _ = r["per-rank refused"]
        assert kind == "CheckpointMismatchError"
        assert (
            f"'data' is a PerRank value with on_world_change='error'; it was saved by 2 ranks "
            f"(ranks 0, 1 holding a value) and {world} ranks are loading" in message
        )


def test_tp_inside_fsdp2_has_strided_shards_with_right_boxes(saved: Any) -> None:
    four = saved[1]
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in four[0]["placements"]
    assert [r["boxes wrong"] for r in four] == [[]] * 4
    assert [r["strided pieces"] for r in four] == [2, 2, 2, 0]
    assert all(r["strided boxes right"] for r in four)


@pytest.mark.parametrize("world", sorted(FSDP_LOADS))
def test_tp_inside_fsdp2_loads_bit_for_bit(loaded: Any, world: int) -> None:
    results = loaded(world)
    assert [r["fsdp"] for r in results] == [[]] * world
    assert all(r["strided"] for r in results)
