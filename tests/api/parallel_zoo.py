"""States whose keys differ between ranks, as large-model training makes them.

- A Megatron-style model cut into pipeline stages (each stage holds different layers; uneven
  splits), its matrices split by tensor parallelism as ``unickpt.ShardedTensor`` blocks and
  DTensors, its optimizer moments as ``unickpt.FlatShard`` ranges cut anywhere.
- Experts spread over ranks (each rank holds different experts).
- A small MLP under tensor parallelism inside FSDP2, as torchtitan lays it out
  (``parallelize_module`` on the ``tp`` mesh, then ``fully_shard`` on the ``dp`` mesh).

Every tensor's global value is a function of its key, so a rank can build what it should hold
under any layout and compare bit for bit.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import unickpt

LAYERS, HIDDEN, VOCAB = 7, 8, 10
EXPERTS = 8

_MESHES: dict[tuple[str, tuple[int, ...]], Any] = {}


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    key = ("-".join(names), shape)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def value_of(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=g).to(dtype)


def _rows(n: int, parts: int, i: int) -> tuple[int, int]:
    cuts = [n * k // parts for k in range(parts + 1)]
    return cuts[i], cuts[i + 1] - cuts[i]


def _flat_part(t: torch.Tensor, parts: int, i: int) -> unickpt.FlatShard:
    """Part ``i`` of ``t``'s flattening, cut at uneven places (as a distributed optimizer)."""
    n = t.numel()
    cuts = [0] + [min(n, n * k // parts + 5) for k in range(1, parts)] + [n]
    lo, hi = cuts[i], cuts[i + 1]
    return unickpt.FlatShard(t.reshape(-1)[lo:hi].clone(), tuple(t.shape), lo)


def stage_layers(pp: int, stage: int) -> list[int]:
    return [int(i) for i in np.array_split(np.arange(LAYERS), pp)[stage]]


def megatron(rank: int, pp: int, tp: int, blank: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s state under ``pp`` pipeline stages of ``tp`` tensor-parallel ranks.

    ``blank``: the same layout with every element -7 and every value unset, to load into.
    """
    stage, t = divmod(rank, tp)
    tp_mesh = mesh((pp, tp), ("pp", "tp"))["tp"]

    def g(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        full = value_of(key, shape, dtype)
        return torch.full_like(full, -7) if blank else full

    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for i in stage_layers(pp, stage):
        p = f"layers.{i}"
        qkv = g(f"model.{p}.qkv.weight", (3 * HIDDEN, HIDDEN), torch.bfloat16)
        lo, n = _rows(3 * HIDDEN, tp, t)
        model[f"{p}.qkv.weight"] = unickpt.ShardedTensor(
            qkv[lo : lo + n].clone(), qkv.shape, (lo, 0)
        )
        proj = g(f"model.{p}.proj.weight", (HIDDEN, HIDDEN))
        lo, n = _rows(HIDDEN, tp, t)
        local = proj[:, lo : lo + n].contiguous()
        model[f"{p}.proj.weight"] = DTensor.from_local(
            local, tp_mesh, [Shard(1)], run_check=False, shape=proj.shape, stride=proj.stride()
        )
        model[f"{p}.norm.weight"] = g(f"model.{p}.norm.weight", (HIDDEN,))
        optim[f"exp_avg.{p}.qkv.weight"] = _flat_part(g(f"optim.exp_avg.{p}.qkv", (24, 8)), tp, t)
        optim[f"exp_avg.{p}.proj.weight"] = _flat_part(g(f"optim.exp_avg.{p}.proj", (8, 8)), tp, t)
    if stage == 0:
        model["embed.weight"] = g("model.embed.weight", (VOCAB, HIDDEN))
    if stage == pp - 1:
        head = g("model.head.weight", (VOCAB, HIDDEN))
        lo, n = _rows(VOCAB, tp, t)
        model["head.weight"] = unickpt.ShardedTensor(head[lo : lo + n].clone(), head.shape, (lo, 0))
        model["head.vocab"] = "unset" if blank else (VOCAB, 16)
    return {"model": model, "optim": optim, "train": {"step": "unset" if blank else 41}}


def experts(rank: int, world: int, per_rank: int, blank: bool = False) -> dict[str, Any]:
    """Experts ``[rank * per_rank, (rank + 1) * per_rank)`` and the router every rank holds."""
    moe: dict[str, Any] = {}
    for e in range(rank * per_rank, (rank + 1) * per_rank):
        w = value_of(f"moe.experts.{e}.w1", (4, 6))
        moe[f"experts.{e}.w1"] = torch.full_like(w, -7) if blank else w
        moe[f"experts.{e}.tokens_seen"] = "unset" if blank else 1000 + e
    router = value_of("moe.router.weight", (EXPERTS, 4))
    moe["router.weight"] = torch.full_like(router, -7) if blank else router
    return {"moe": moe}


def leaves(state: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested dict by dotted key."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def local_of(leaf: Any) -> Any:
    if isinstance(leaf, DTensor):
        return leaf.to_local()
    if isinstance(leaf, (unickpt.ShardedTensor, unickpt.FlatShard)):
        return leaf.local
    return leaf


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Keys whose loaded leaf differs from the expected one (tensors bitwise)."""
    a, b = leaves(got), leaves(want)
    wrong = sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        x, y = local_of(a[key]), local_of(b[key])
        if isinstance(y, torch.Tensor):
            same = isinstance(x, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        else:
            same = x == y
        if not same:
            wrong.append(key)
    return wrong


class TPMLP(nn.Module):
    """Column-parallel up projection, row-parallel down projection; uneven sizes on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


def tp_in_fsdp2(dp: int, tp: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The MLP under ``tp``-way tensor parallelism inside ``dp``-way FSDP2 (either may be 1)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    model = TPMLP()
    if dp * tp > 1:
        world = mesh((dp, tp), ("dp", "tp"))
        if tp > 1:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            parallelize_module(model, world["tp"], plan)
        if dp > 1:
            fully_shard(model, mesh=world["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, dp: int, tp: int) -> None:
    """One step on this data-parallel rank's part of a fixed batch."""
    data = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    per = 8 // dp
    mine = data[(rank // tp) * per : (rank // tp + 1) * per]
    model(mine).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer moments, gathered whole (every rank must call it)."""
    out = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        out[name] = _full(p.detach())
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"{names[id(p)]}.{k}"] = _full(v)
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()
