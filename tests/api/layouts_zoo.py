"""Every way a global tensor can be split across ranks, for resharding tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import unickpt

_MESHES: dict[tuple[int, ...], Any] = {}


def mesh(shape: tuple[int, ...]) -> Any:
    if shape not in _MESHES:
        names = ("dp", "tp")[: len(shape)]
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape]


def _two_d(world: int) -> tuple[int, int]:
    return (world // 2, 2) if world % 2 == 0 else (world, 1)


def replicated(t: torch.Tensor, rank: int, world: int) -> Any:
    return t.clone()


def dt_row(t: torch.Tensor, rank: int, world: int) -> Any:
    return distribute_tensor(t, mesh((world,)), [Shard(0)])


def dt_col(t: torch.Tensor, rank: int, world: int) -> Any:
    return distribute_tensor(t, mesh((world,)), [Shard(1)])


def dt_2d(t: torch.Tensor, rank: int, world: int) -> Any:
    return distribute_tensor(t, mesh(_two_d(world)), [Shard(0), Shard(1)])


def dt_rep_shard(t: torch.Tensor, rank: int, world: int) -> Any:
    return distribute_tensor(t, mesh(_two_d(world)), [Replicate(), Shard(1)])


def megatron(t: torch.Tensor, rank: int, world: int) -> Any:
    blocks = min(world, 2)
    width = t.shape[1]
    b = rank % blocks
    lo, hi = b * width // blocks, (b + 1) * width // blocks
    offsets = (0, lo) + (0,) * (t.dim() - 2)
    return unickpt.ShardedTensor(t[:, lo:hi].clone(), tuple(t.shape), offsets)


def flat(t: torch.Tensor, rank: int, world: int) -> Any:
    n = t.numel()
    cuts = [0] + [min(n, n * i // world + (i * 7) % 5) for i in range(1, world)] + [n]
    lo, hi = cuts[rank], cuts[rank + 1]
    return unickpt.FlatShard(t.reshape(-1)[lo:hi].clone(), tuple(t.shape), lo)


LAYOUTS: dict[str, Callable[[torch.Tensor, int, int], Any]] = {
    "replicated": replicated,
    "dt_row": dt_row,
    "dt_col": dt_col,
    "dt_2d": dt_2d,
    "dt_rep_shard": dt_rep_shard,
    "megatron": megatron,
    "flat": flat,
}


def global_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "a": torch.randn(10, 12, generator=g),
        "b": torch.randn(5, 6, 7, generator=g).to(torch.bfloat16),
        "c": torch.randint(-1000, 1000, (7, 9), generator=g, dtype=torch.int64),
    }


def local_of(leaf: Any) -> torch.Tensor:
    if isinstance(leaf, DTensor):
        return leaf.to_local()
    if isinstance(leaf, (unickpt.ShardedTensor, unickpt.FlatShard)):
        return leaf.local
    return leaf


def zeroed(leaf: Any) -> Any:
    """The same layout as ``leaf``, every element set to a sentinel."""
    local_of(leaf).fill_(-7)
    return leaf
