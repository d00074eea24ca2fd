"""Megatron-Core sharded state dicts saved and loaded by unickpt, on real gloo ranks.

A GPTModel with SwiGLU and grouped-query attention (local layer spec) is saved at TP=2, then
loaded at TP=1 and at PP=2 into models built from another seed (and one saved by two
data-parallel replicas, written once, loads at TP=2): every parameter equals the
saved model's bitwise. The logits equal the saved model's to float32 rounding (the TP=2 forward
sums its row-parallel products in another order than TP=1; measured difference about 3e-8).
Megatron's DistributedOptimizer reshards over data parallelism (``dp_reshardable``) and over
tensor and data parallelism (``fully_reshardable``), its state bitwise; the sharding types that
do not reshard are refused. The GPTModel with a mixture of experts (SequentialMLP experts, top-2
router) reshards over expert parallelism (EP=2 <-> EP=1) and expert tensor parallelism, every
expert and the router bitwise.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install megatron-core")

from tests.distributed import run_ranks
from tests.integrations import megatron_job as mj

pytestmark = pytest.mark.slow

ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
SPLIT = ("linear_qkv.", "linear_fc1.", "word_embeddings.", "output_layer.", *ROW_PARALLEL)


def _unsharded(name: str, arrays: list[Any]) -> list[torch.Tensor]:
    """A TP=1 tensor (a parameter, or its Adam state) from its TP shards, the way Megatron
    splits it; for a replicated one, each rank's copy (one of them is saved)."""
    parts = [torch.from_numpy(a) for a in arrays]
    param = name.removesuffix(".exp_avg").removesuffix(".exp_avg_sq").removesuffix(".fp32_param")
    if not any(s in param for s in SPLIT):
        return parts  # layer norms, row-parallel biases, position embeddings
    if param.endswith(ROW_PARALLEL):
        return [torch.cat(parts, 1)]
    if "linear_fc1" in param:  # SwiGLU: each rank holds its gate rows, then its up rows
        halves = [p.chunk(2, 0) for p in parts]
        return [torch.cat([h[0] for h in halves] + [h[1] for h in halves])]
    return [torch.cat(parts, 0)]  # column parallel (qkv by query groups), vocabulary parallel


def _assert_saved(loaded: dict[str, Any], saved: dict[str, list[torch.Tensor]]) -> None:
    assert loaded.keys() == saved.keys()
    for name, copies in saved.items():
        value = torch.from_numpy(loaded[name])
        assert any(torch.equal(value, c) for c in copies), name


@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("megatron") / "ckpt")
    ranks = run_ranks(2, mj.save_at, path, 2, 1, timeout_s=300)
    assert (ranks[0]["logits"] == ranks[1]["logits"]).all()
    names = ranks[0]["params"]
    params = {k: _unsharded(k, [r["params"][k] for r in ranks]) for k in names}
    return path, {"logits": torch.from_numpy(ranks[0]["logits"]), "params": params}


def test_tp2_checkpoint_loads_at_tp1(saved_tp2: tuple[str, dict[str, Any]]) -> None:
    path, saved = saved_tp2
    loaded = run_ranks(1, mj.load_at, path, 1, 1, timeout_s=300)[0]
    assert loaded["params"].keys() == saved["params"].keys()
    _assert_saved(loaded["params"], saved["params"])
    logits = torch.from_numpy(loaded["logits"])
    torch.testing.assert_close(logits, saved["logits"], rtol=0, atol=1e-6)


def _global_layer(name: str, stage: int, layers_per_stage: int) -> str:
    return re.sub(
        r"decoder\.layers\.(\d+)\.",
        lambda m: f"decoder.layers.{int(m.group(1)) + stage * layers_per_stage}.",
        name,
    )


def test_tp2_checkpoint_loads_at_pp2(saved_tp2: tuple[str, dict[str, Any]]) -> None:
    path, saved = saved_tp2
    stages = run_ranks(2, mj.load_at, path, 1, 2, timeout_s=300)
    seen: dict[str, Any] = {}
    for stage, result in enumerate(stages):
        for name, value in result["params"].items():
            seen[_global_layer(name, stage, 1)] = value
    _assert_saved(seen, saved["params"])


def test_adam_state_saved_at_tp2_loads_at_tp1(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    ranks = run_ranks(2, mj.save_trained, path, 2, 1, timeout_s=300)
    loaded = run_ranks(1, mj.load_trained, path, 1, 1, timeout_s=300)[0]
    for what in ("params", "adam"):
        saved = {k: _unsharded(k, [r[what][k] for r in ranks]) for k in ranks[0][what]}
        _assert_saved(loaded[what], saved)
    assert any(abs(v).sum() > 0 for v in loaded["adam"].values())  # a step was taken


def _stored_bytes(path: str) -> int:
    """The bytes of all chunks the checkpoint stores (a replica stored twice counts twice)."""
    from unickpt.engine.commit import read_checkpoint
    from unickpt.storage.registry import open_storage

    return read_checkpoint(open_storage(path))[1].total_bytes


def test_blocks_objects_and_replicas_round_trip(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(2, mj.save_hand, path, timeout_s=120)
    full = torch.arange(24, dtype=torch.float32).view(4, 6)
    assert _stored_bytes(path) == (24 + 6 + 3 * 2) * 4  # norm, held by both ranks, once
    for rank, got in enumerate(run_ranks(2, mj.load_hand, path, timeout_s=120)):
        assert torch.equal(torch.from_numpy(got["w"]), full[2 * rank : 2 * rank + 2])
        assert torch.equal(torch.from_numpy(got["w_returned"]), full[2 * rank : 2 * rank + 2])
        assert torch.equal(torch.from_numpy(got["norm"]), torch.ones(6))
        assert got["rng_seed"] == 10 + rank
        assert torch.equal(torch.from_numpy(got["rng_t"]), torch.full((3,), float(rank + 1)))
        assert got["iteration"] == 7


def test_dp2_checkpoint_writes_one_copy_and_loads_at_tp2(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    ranks = run_ranks(2, mj.save_at, path, 1, 1, timeout_s=300)  # TP=1: two data-parallel replicas
    saved = {k: [torch.from_numpy(v)] for k, v in ranks[0]["params"].items()}
    assert _stored_bytes(path) == sum(v[0].numel() * 4 for v in saved.values())
    loaded = run_ranks(2, mj.load_at, path, 2, 1, timeout_s=300)
    names = loaded[0]["params"]
    gathered = {k: _unsharded(k, [r["params"][k] for r in loaded]) for k in names}
    assert gathered.keys() == saved.keys()
    for name, copies in gathered.items():
        assert all(torch.equal(c, saved[name][0]) for c in copies), name


def _whole(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Each parameter's DistributedOptimizer state, whole, from the ranges data-parallel ranks
    own (``megatron_job.dist_adam_state``); the ranges must tile it."""
    parts: dict[str, dict[int, Any]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for state in ranks:
        for name, (start, shape, values) in state.items():
            parts.setdefault(name, {})[start] = torch.from_numpy(values)
            shapes[name] = shape
    whole = {}
    for name, ranges in parts.items():
        flat = torch.cat([ranges[s] for s in sorted(ranges)])
        whole[name] = flat.view(shapes[name])  # fails unless the ranges cover the parameter
    return whole


def _assert_equal(loaded: dict[str, torch.Tensor], saved: dict[str, list[torch.Tensor]]) -> None:
    assert loaded.keys() == saved.keys()
    for name, copies in saved.items():
        assert any(torch.equal(loaded[name], c) for c in copies), name


def _bucket_chunks(path: str) -> dict[str, int]:
    """The chunks stored for each DistributedOptimizer bucket tensor."""
    from unickpt.engine.commit import read_checkpoint
    from unickpt.storage.registry import open_storage

    tensors = read_checkpoint(open_storage(path))[1].tensors
    return {k: len(t.chunks) for k, t in tensors.items() if ".bucket_idx_" in k}


def test_distributed_optimizer_reshards_over_data_and_tensor_parallelism(tmp_path: Path) -> None:
    """Megatron's DistributedOptimizer (Adam, one step) saved and loaded at other layouts:
    ``dp_reshardable`` DP=2 -> DP=1 and DP=1 -> DP=2, ``fully_reshardable`` DP=2 -> DP=1,
    TP=2 -> TP=1 and TP=2 -> TP=1 x DP=2. exp_avg, exp_avg_sq and the fp32 main parameters,
    put together from the ranges each rank owns, equal the saved ones bitwise."""
    p = {name: str(tmp_path / name) for name in ("dp2", "dp2_full", "tp2_full", "dp1")}
    saved = run_ranks(
        2,
        mj.dist_steps,
        [
            ("save", p["dp2"], 1, "dp_reshardable"),
            ("save", p["dp2_full"], 1, "fully_reshardable"),
            ("save", p["tp2_full"], 2, "fully_reshardable"),
        ],
        timeout_s=300,
    )
    one = run_ranks(
        1,
        mj.dist_steps,
        [
            ("load", p["dp2"], 1, "dp_reshardable"),
            ("load", p["dp2_full"], 1, "fully_reshardable"),
            ("load", p["tp2_full"], 1, "fully_reshardable"),
            ("save", p["dp1"], 1, "dp_reshardable"),
        ],
        timeout_s=300,
    )[0]
    two = run_ranks(
        2,
        mj.dist_steps,
        [("load", p["dp1"], 1, "dp_reshardable"), ("load", p["tp2_full"], 1, "fully_reshardable")],
        timeout_s=300,
    )
    dp2, dp2_full = (_whole([r[i] for r in saved]) for i in (0, 1))
    assert any(v.abs().sum() > 0 for k, v in dp2.items() if k.endswith(".exp_avg"))
    _assert_equal(_whole([one[0]]), {k: [v] for k, v in dp2.items()})
    _assert_equal(_whole([one[1]]), {k: [v] for k, v in dp2_full.items()})
    _assert_equal(_whole([r[0] for r in two]), {k: [v] for k, v in _whole([one[3]]).items()})
    tp_ranks = [_whole([r[2]]) for r in saved]  # TP=2: each rank owns its whole TP shard
    tp2 = {k: _unsharded(k, [t[k].numpy() for t in tp_ranks]) for k in tp_ranks[0]}
    _assert_equal(_whole([one[2]]), tp2)
    _assert_equal(_whole([r[1] for r in two]), tp2)
    # each data-parallel rank's range of a bucket is one flat range: one chunk per rank
    assert set(_bucket_chunks(p["dp2"]).values()) == {2}
    assert set(_bucket_chunks(p["dp1"]).values()) == {1}


@pytest.mark.parametrize("sharding_type", ["dp_zero_gather_scatter", "fully_sharded_model_space"])
def test_distributed_optimizer_sharding_types_that_do_not_reshard_are_refused(
    tmp_path: Path, sharding_type: str
) -> None:
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    from unickpt.errors import CheckpointError
    from unickpt.integrations import megatron as um

    state = {
        "optimizer": {
            "param_state": LocalNonpersistentObject(None),
            "param_state_sharding_type": sharding_type,
        }
    }
    expected = (
        f"'optimizer.param_state_sharding_type' is '{sharding_type}'.*"
        "'dp_reshardable'.*'fully_reshardable'"
    )
    with pytest.raises(CheckpointError, match=expected):
        um.save(state, str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=expected):
        um.load(state, str(tmp_path / "ckpt"))


def test_flattened_ranges_are_refused_naming_the_sharding_types_that_work(tmp_path: Path) -> None:
    """What an older megatron-core's 'fully_sharded_model_space' gives (0.16 refuses to build
    it): a ShardedTensor holding a flat range of its block."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from unickpt.errors import CheckpointError
    from unickpt.integrations import megatron as um

    sh = ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.w", torch.zeros(4, 6))
    sh.flattened_range = slice(3, 9)
    sh.data = torch.zeros(6)
    with pytest.raises(CheckpointError, match=r"flattened_range.*'dp_reshardable'"):
        um.save({"optimizer": {"param_state": {0: {"exp_avg": sh}}}}, str(tmp_path / "ckpt"))


def _gathered(ranks: list[dict[str, Any]], tp: int, expert_tp: int) -> dict[str, Any]:
    """Each parameter unsharded from the ranks holding it (experts by their global index),
    split over ``expert_tp`` ranks for an expert's, ``tp`` for the others."""
    names = {name for r in ranks for name in r}
    gathered = {}
    for name in sorted(names):
        arrays = [r[name] for r in ranks if name in r]
        split = expert_tp if ".experts." in name else tp
        if split > 1:
            gathered[name] = _unsharded(name, arrays)
        else:
            gathered[name] = [torch.from_numpy(a) for a in arrays]
    return gathered


def _assert_params(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    """Every copy loaded equals a saved copy, bitwise."""
    assert loaded.keys() == saved.keys()
    for name, copies in loaded.items():
        for c in copies:
            assert any(torch.equal(c, s) for s in saved[name]), name


def test_mixture_of_experts_reshards_over_expert_and_tensor_parallelism(tmp_path: Path) -> None:
    """A GPTModel with 4 SwiGLU experts per layer (local spec, top-2 routing) saved at one
    layout loads at another into a model of another seed: EP=2 -> EP=1, EP=1 -> EP=2,
    TP=2 x EP=2 -> TP=1 x EP=1, EP=2 -> TP=2 with the experts split over TP=2, and experts
    replicated over two expert-data-parallel ranks -> one rank. Every parameter (each
    expert's, the router's) equals the saved one bitwise; the logits too at the same TP, within
    1e-6 at another (measured 4.5e-8); replicas are stored once."""
    p = {name: str(tmp_path / name) for name in ("ep2", "tp2_ep2", "edp2", "ep1")}
    saved = run_ranks(
        2,
        mj.moe_steps,
        [
            ("save", p["ep2"], 1, 2, 1),
            ("save", p["tp2_ep2"], 2, 2, 1),
            ("save", p["edp2"], 1, 1, 1),
        ],
        timeout_s=300,
    )
    one = run_ranks(
        1,
        mj.moe_steps,
        [
            ("load", p["ep2"], 1, 1, 1),
            ("load", p["tp2_ep2"], 1, 1, 1),
            ("load", p["edp2"], 1, 1, 1),
            ("save", p["ep1"], 1, 1, 1),
        ],
        timeout_s=300,
    )[0]
    two = run_ranks(
        2,
        mj.moe_steps,
        [("load", p["ep1"], 1, 2, 1), ("load", p["ep2"], 2, 1, 2)],
        timeout_s=300,
    )
    cases = [  # (loaded, its tp, expert tp), (saved, its tp, expert tp)
        (([one[0]], 1, 1), ([r[0] for r in saved], 1, 1)),
        (([one[1]], 1, 1), ([r[1] for r in saved], 2, 1)),
        (([one[2]], 1, 1), ([r[2] for r in saved], 1, 1)),
        (([r[0] for r in two], 1, 1), ([one[3]], 1, 1)),
        (([r[1] for r in two], 2, 2), ([r[0] for r in saved], 1, 1)),
    ]
    for (loaded, tp, etp), (source, saved_tp, saved_etp) in cases:
        expected = _gathered([s["params"] for s in source], saved_tp, saved_etp)
        _assert_params(_gathered([r["params"] for r in loaded], tp, etp), expected)
        assert any(".experts.3." in name for name in expected)
        assert any(".router." in name for name in expected)
        for r in loaded:
            got = torch.from_numpy(r["logits"])
            want = torch.from_numpy(source[0]["logits"])
            atol = 0.0 if tp == saved_tp else 1e-6  # the same TP sums in the same order
            torch.testing.assert_close(got, want, rtol=0, atol=atol)
    # what both ranks hold (dense parameters at EP=2, everything at EP=1) is stored once
    for i, name in ((0, "ep2"), (2, "edp2")):
        unique = _gathered([r[i]["params"] for r in saved], 1, 1)
        assert _stored_bytes(p[name]) == sum(v[0].numel() * 4 for v in unique.values())


def test_a_save_or_load_that_fails_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    """What a rank prepares alone before the collective save or load (mapping its entries,
    reading the saved common keys) is agreed: its failure raises on every rank at once."""
    path = str(tmp_path / "ckpt")
    results = run_ranks(2, mj.one_rank_fails, path, timeout_s=300)
    assert results[0] == results[1]
    saved, good, loaded = results[0]
    assert saved.startswith(
        "mapping the Megatron sharded state dict failed on 1 of 2 ranks:\n  rank 1: "
        "CheckpointError: ShardedTensor 'optimizer.exp_avg.w' has a flattened_range"
    ), saved
    assert good == "done"
    assert loaded.startswith(
        "preparing the Megatron load failed on 1 of 2 ranks:\n  rank 1: "
        f"CheckpointNotFoundError: no checkpoint at {path}-elsewhere: "
    ), loaded
