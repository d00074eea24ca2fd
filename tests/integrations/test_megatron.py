"""Megatron-Core sharded state dicts saved and loaded by unickpt, on real gloo ranks.

A GPTModel with SwiGLU and grouped-query attention (local layer spec) is saved at TP=2, then
loaded at TP=1 and at PP=2 into models built from another seed: every parameter equals the
saved model's bitwise. The logits equal the saved model's to float32 rounding (the TP=2 forward
sums its row-parallel products in another order than TP=1; measured difference about 3e-8).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install megatron-core")

from tests.distributed import run_ranks
from tests.integrations import megatron_job as mj

ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def _unsharded(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """A TP=1 parameter from its TP shards, the way Megatron splits it."""
    if (
        all(p.shape == parts[0].shape for p in parts)
        and all(torch.equal(p, parts[0]) for p in parts)
        and not any(s in name for s in ("linear_qkv", "linear_fc1", "embeddings.weight"))
    ):
        return parts[0]  # replicated: layer norms, row-parallel biases, positions
    if name.endswith(ROW_PARALLEL):
        return torch.cat(parts, 1)
    if "linear_fc1" in name:  # SwiGLU: each rank holds its gate rows, then its up rows
        halves = [p.chunk(2, 0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if name == "embedding.position_embeddings.weight":
        return parts[0]
    return torch.cat(parts, 0)  # column parallel (qkv by query groups), vocabulary parallel


@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("megatron") / "ckpt")
    ranks = run_ranks(2, mj.save_at, path, 2, 1, timeout_s=300)
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    names = ranks[0]["params"]
    params = {k: _unsharded(k, [r["params"][k] for r in ranks]) for k in names}
    return path, {"logits": ranks[0]["logits"], "params": params}


def test_tp2_checkpoint_loads_at_tp1(saved_tp2: tuple[str, dict[str, Any]]) -> None:
    path, saved = saved_tp2
    loaded = run_ranks(1, mj.load_at, path, 1, 1, timeout_s=300)[0]
    assert loaded["params"].keys() == saved["params"].keys()
    for name, value in saved["params"].items():
        assert torch.equal(loaded["params"][name], value), name
    torch.testing.assert_close(loaded["logits"], saved["logits"], rtol=0, atol=1e-6)


def _global_layer(name: str, stage: int, layers_per_stage: int) -> str:
    return re.sub(
        r"decoder\.layers\.(\d+)\.",
        lambda m: f"decoder.layers.{int(m.group(1)) + stage * layers_per_stage}.",
        name,
    )


def test_tp2_checkpoint_loads_at_pp2(saved_tp2: tuple[str, dict[str, Any]]) -> None:
    path, saved = saved_tp2
    stages = run_ranks(2, mj.load_at, path, 1, 2, timeout_s=300)
    seen: dict[str, torch.Tensor] = {}
    for stage, result in enumerate(stages):
        for name, value in result["params"].items():
            seen[_global_layer(name, stage, 1)] = value
    assert seen.keys() == saved["params"].keys()
    for name, value in saved["params"].items():
        assert torch.equal(seen[name], value), name
