"""Fused, padded and replicated tensors, saved and loaded online on real gloo ranks.

One spawned world of 4 ranks checks every case: a tensor-parallel size ``tp`` is simulated by
giving rank ``r`` the tensor-parallel rank ``r % tp`` (the other ranks are data-parallel
replicas). Each rank builds its locals from known whole tensors; after a load, every local is
compared bit for bit with the slices that rank should hold, and padding with the values it held
before.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import unickpt
from tests.distributed import run_ranks

H, F = 6, 8  # hidden size; rows of gate (and of up)
GROUPS, PER_GROUP, HEAD = 4, 2, 3  # query groups, query heads per group, head size
VOCAB, HIDDEN = 1030, 4


def _whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "gate": rand(F, H),
        "up": rand(F, H),
        "gate_b": rand(F),
        "up_b": rand(F),
        "q": rand(GROUPS * PER_GROUP * HEAD, H),
        "k": rand(GROUPS * HEAD, H),
        "v": rand(GROUPS * HEAD, H),
        "emb": rand(VOCAB, HIDDEN),
        "proj": rand(5, 6),
    }


def _glu_local(a: torch.Tensor, b: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    n = a.shape[0] // tp
    return torch.cat([a[tp_rank * n : (tp_rank + 1) * n], b[tp_rank * n : (tp_rank + 1) * n]])


def _qkv_local(w: dict[str, torch.Tensor], tp_rank: int, tp: int) -> torch.Tensor:
    groups, q_rows = GROUPS // tp, PER_GROUP * HEAD
    parts = []
    for g in range(tp_rank * groups, (tp_rank + 1) * groups):
        parts += [w["q"][g * q_rows : (g + 1) * q_rows], w["k"][g * HEAD : (g + 1) * HEAD]]
        parts.append(w["v"][g * HEAD : (g + 1) * HEAD])
    return torch.cat(parts)


def _bias_fused(local: torch.Tensor, tp_rank: int, tp: int) -> unickpt.Fused:
    """The fused GLU bias, described piece by piece (what fused_glu does for the weight)."""
    n = F // tp
    pieces = [("gate", (F,), (tp_rank * n,), n), ("up", (F,), (tp_rank * n,), n)]
    return unickpt.Fused(local, dim=0, pieces=pieces)


def _layout(tp_rank: int, tp: int) -> dict[str, Any]:
    return {
        "*.linear_fc1.weight": unickpt.fused_glu(tp_rank, tp),
        "*.linear_qkv.weight": unickpt.fused_qkv(tp_rank, tp, GROUPS, PER_GROUP, HEAD),
    }


def _model(w: dict[str, torch.Tensor], tp_rank: int, tp: int, fill: float | None) -> dict:
    """The fused tensors of one layer at ``tp``: the right values, or ``fill`` everywhere."""
    fc1 = _glu_local(w["gate"], w["up"], tp_rank, tp)
    bias = _glu_local(w["gate_b"], w["up_b"], tp_rank, tp)
    qkv = _qkv_local(w, tp_rank, tp)
    if fill is not None:
        fc1, bias, qkv = (torch.full_like(t, fill) for t in (fc1, bias, qkv))
    return {
        "layers.0.mlp.linear_fc1.weight": fc1,
        "layers.0.mlp.linear_fc1.bias": _bias_fused(bias, tp_rank, tp),
        "layers.0.attn.linear_qkv.weight": qkv,
    }


def _padded(rows: int, tp: int) -> int:
    """The vocabulary padded to a multiple of ``rows`` per tensor-parallel rank."""
    return -(-VOCAB // (rows * tp)) * rows * tp


def _save(rank: int, w: dict[str, torch.Tensor], path: str) -> None:
    tp_rank, tp = rank % 2, 2
    model = _model(w, tp_rank, tp, None)
    held = _padded(128, tp) // tp  # padding 128 at TP=2: 1152 rows, 576 a rank
    emb = torch.full((held, HIDDEN), 999.0)
    mine = w["emb"][tp_rank * held : (tp_rank + 1) * held]
    emb[: len(mine)] = mine
    proj = torch.full((5, 8), 999.0)  # padded along dim 1
    proj[:, :6] = w["proj"]
    state = {
        "model": {
            **model,
            "embedding.word_embeddings.weight": emb,
            "proj": unickpt.Padded(proj, (5, 6)),
        }
    }
    layout = {
        **_layout(tp_rank, tp),
        "*.word_embeddings.weight": unickpt.padded_vocab(VOCAB, tp_rank, tp),
    }
    unickpt.save(path, state, layout=layout)


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        raise AssertionError(f"{name}: loaded {got} but expected {want}")


def _load_fused(rank: int, w: dict[str, torch.Tensor], path: str, tp: int) -> None:
    tp_rank = rank % tp
    model = _model(w, tp_rank, tp, fill=-3.0)
    unickpt.load(path, {"model": model}, layout=_layout(tp_rank, tp), strict=False)
    want = _model(w, tp_rank, tp, None)
    _check(
        f"tp {tp} fc1",
        model["layers.0.mlp.linear_fc1.weight"],
        want["layers.0.mlp.linear_fc1.weight"],
    )
    bias = model["layers.0.mlp.linear_fc1.bias"].local
    _check(f"tp {tp} fc1 bias", bias, want["layers.0.mlp.linear_fc1.bias"].local)
    _check(
        f"tp {tp} qkv",
        model["layers.0.attn.linear_qkv.weight"],
        want["layers.0.attn.linear_qkv.weight"],
    )


def _load_unfused(rank: int, w: dict[str, torch.Tensor], path: str) -> None:
    """An unfused model: gate_proj/up_proj parameters (the saved names mapped to theirs with
    keys=), Q as ShardedTensor blocks, K as a DTensor sharded over the 4 ranks, V plain (under
    the saved names)."""
    mlp = torch.nn.ModuleDict(
        {
            "gate_proj": torch.nn.Linear(H, F, bias=False),
            "up_proj": torch.nn.Linear(H, F, bias=False),
        }
    )
    rows = w["q"].shape[0] // 4
    q = unickpt.ShardedTensor(torch.zeros(rows, H), w["q"].shape, (rank * rows, 0))
    mesh = init_device_mesh("cpu", (4,))
    k_rows = w["k"].shape[0] // 4
    k = DTensor.from_local(torch.zeros(k_rows, H), mesh, [Shard(0)], run_check=False)
    v = torch.zeros_like(w["v"])
    saved = "model.layers.0.mlp.linear_fc1.weight"
    keys = {f"{saved}.gate": "model.layers.0.mlp.gate_proj.weight"}
    keys[f"{saved}.up"] = "model.layers.0.mlp.up_proj.weight"
    state = {
        "model": {
            "layers.0.mlp.gate_proj.weight": mlp["gate_proj"].weight,
            "layers.0.mlp.up_proj.weight": mlp["up_proj"].weight,
            "layers.0.attn.linear_qkv.weight.q": q,
            "layers.0.attn.linear_qkv.weight.k": k,
            "layers.0.attn.linear_qkv.weight.v": v,
        }
    }
    unickpt.load(path, state, strict=False, keys=keys)
    _check("unfused gate", mlp["gate_proj"].weight.detach(), w["gate"])
    _check("unfused up", mlp["up_proj"].weight.detach(), w["up"])
    _check("unfused q", q.local, w["q"][rank * rows : (rank + 1) * rows])
    _check("unfused k", k.to_local(), w["k"][rank * k_rows : (rank + 1) * k_rows])
    _check("unfused v", v, w["v"])


def _load_padded(rank: int, w: dict[str, torch.Tensor], path: str) -> None:
    """Padding 64 at TP=4 (a DTensor), at TP=2 (ShardedTensor), and none (plain)."""
    rows4 = _padded(64, 4) // 4  # 1088 rows, 272 a rank
    mesh = init_device_mesh("cpu", (4,))
    dt = DTensor.from_local(torch.full((rows4, HIDDEN), -5.0), mesh, [Shard(0)], run_check=False)
    rows2 = _padded(64, 2) // 2  # 1088 rows, 544 a rank
    tp_rank = rank % 2
    block = unickpt.ShardedTensor(
        torch.full((rows2, HIDDEN), -5.0), (2 * rows2, HIDDEN), (tp_rank * rows2, 0)
    )
    plain = torch.zeros(VOCAB, HIDDEN)
    proj = torch.full((6, 7), -5.0)
    for emb in (dt, block, plain):
        key = "embedding.word_embeddings.weight"
        state = {"model": {key: emb, "proj": unickpt.Padded(proj, (5, 6))}}
        layout = {"*.word_embeddings.weight": unickpt.padded_vocab(VOCAB)}
        unickpt.load(path, state, layout=layout if emb is not plain else None, strict=False)
    for local, start in ((dt.to_local(), rank * rows4), (block.local, tp_rank * rows2)):
        logical = max(0, min(len(local), VOCAB - start))
        _check("padded rows", local[:logical], w["emb"][start : start + logical])
        _check("padding kept", local[logical:], torch.full_like(local[logical:], -5.0))
    _check("unpadded", plain, w["emb"])
    _check("proj", proj[:5, :6], w["proj"])
    _check("proj padding", proj[5:], torch.full((1, 7), -5.0))
    _check("proj padding cols", proj[:, 6:], torch.full((6, 1), -5.0))


def _replicated(rank: int, path: str) -> dict[str, Any]:
    """check: equal copies save; a differing copy fails the save on every rank (rank 0 holds
    no copy of 'model.final_norm'); mean: the mean of the copies is saved."""
    base = torch.linspace(-1.0, 1.0, 5)
    norm: dict[str, Any] = {"ln": unickpt.Replicated(base.clone(), "check")}
    if rank:
        norm["final_norm"] = unickpt.Replicated(base.clone(), "check")
    unickpt.save(f"{path}/check-ok", {"model": norm})
    bad = base.clone()
    if rank == 3:
        bad[2] += 0.25
    norm["final_norm" if rank else "ln"] = unickpt.Replicated(
        bad if rank else base.clone(), "check"
    )
    try:
        unickpt.save(f"{path}/check-bad", {"model": norm})
        error = ""
    except unickpt.CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    mine = base + rank
    unickpt.save(f"{path}/mean", {"model": {"ln": unickpt.Replicated(mine, "mean")}})
    _check("mean leaves the copy", mine, base + rank)
    loaded = torch.zeros(5)
    unickpt.load(f"{path}/mean", {"model": {"ln": loaded}})
    return {"error": error, "mean": loaded}


def _all_cases(rank: int, world: int, path: str) -> dict[str, Any]:
    w = _whole()
    _save(rank, w, f"{path}/tp2")
    for tp in (1, 2, 4):
        _load_fused(rank, w, f"{path}/tp2", tp)
    _load_unfused(rank, w, f"{path}/tp2")
    _load_padded(rank, w, f"{path}/tp2")
    return _replicated(rank, f"{path}/replicated")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("online_layouts"))
    return run_ranks(4, _all_cases, path, timeout_s=300)


def test_fused_padded_and_unfused_loads_hold_the_expected_slices(results: list) -> None:
    """The ranks compare every loaded local with its expected slices; reaching here means
    all of them matched (fused at TP 1, 2, 4; unfused; padded at 64, 64 x 2, none)."""
    assert len(results) == 4


def test_replicated_check_fails_on_every_rank_naming_key_and_difference(results: list) -> None:
    for r in results:
        assert r["error"].startswith("CheckpointMismatchError: Replicated(reduce='check')")
        assert (
            "'model.final_norm' differs by up to 0.25 between the copies of ranks 1, 2, 3"
            in r["error"]
        )
        assert "(at element (2,))" in r["error"]
        assert "model.ln" not in r["error"]


def test_replicated_mean_saves_the_mean_of_the_copies(results: list) -> None:
    base = torch.linspace(-1.0, 1.0, 5)
    want = torch.stack([base + r for r in range(4)]).double().mean(0).float()
    for r in results:
        assert torch.equal(r["mean"], want)
