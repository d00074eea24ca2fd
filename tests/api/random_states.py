"""Random training states for resharding tests: tensors of random shapes (empty ones too) and
dtypes, each split across ranks by a random layout, and random engine sizes.

Everything is a pure function of a seed and (rank, world), so every rank of a save and of a
later load on another world size builds the same global tensors.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import unickpt
from tests.api.layouts_zoo import local_of, mesh

DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
)
SIZES = (1, 2, 3, 5, 7, 13, 31, 64, 100, 257, 513, 1031)
MAX_ELEMENTS = 1 << 18


def global_tensor(rng: random.Random, seed: int) -> torch.Tensor:
    """0 to 3 dimensions, some of them 0, at most :data:`MAX_ELEMENTS` elements."""
    dims = [
        rng.choice(SIZES) if rng.random() < 0.85 else 0 for _ in range(rng.choice((0, 1, 2, 2, 3)))
    ]
    while torch.Size(dims).numel() > MAX_ELEMENTS:
        dims[dims.index(max(dims))] //= 5
    dtype = rng.choice(DTYPES)
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(dims, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(dims, generator=g, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(10**6)), min(info.max, 10**6)
    return torch.randint(lo, hi, dims, generator=g, dtype=torch.int64).to(dtype)


def _cuts(rng: random.Random, n: int, parts: int) -> list[int]:
    """``parts`` consecutive ranges of ``0..n``, of random (possibly empty) lengths."""
    return [0, *sorted(rng.randint(0, n) for _ in range(parts - 1)), n]


def _factor(rng: random.Random, world: int) -> tuple[int, int]:
    return rng.choice([(a, world // a) for a in range(1, world + 1) if world % a == 0])


def split(t: torch.Tensor, layout_seed: int, rank: int, world: int) -> tuple[Any, str]:
    """This rank's leaf of ``t`` under a layout drawn from ``layout_seed``, and its name:
    replicated; a DTensor on a 1-D or 2-D mesh (uneven and empty shards, a dimension sharded
    twice); explicit shards of one dimension in uneven blocks (replicated over the other ranks)
    or of a grid of uneven blocks; flat ranges of random lengths."""
    rng = random.Random(layout_seed)
    kinds = (
        ("replicated", "dtensor", "dtensor-2d", "blocks", "grid", "flat")
        if t.dim()
        else ("replicated", "dtensor")
    )
    kind = rng.choice(kinds)
    if kind == "replicated":
        return t.clone(), kind
    if kind == "dtensor":
        placement = Shard(rng.randrange(t.dim())) if t.dim() else Replicate()
        return distribute_tensor(t, mesh((world,)), [placement]), f"{kind} {placement}"
    if kind == "dtensor-2d":
        shape = _factor(rng, world)
        placements = [
            Shard(rng.randrange(t.dim())) if rng.random() < 0.8 else Replicate() for _ in shape
        ]
        return distribute_tensor(t, mesh(shape), placements), f"{kind} {shape} {placements}"
    if kind == "blocks" or (kind == "grid" and t.dim() == 1):
        dim = rng.randrange(t.dim())
        cuts = _cuts(rng, t.shape[dim], rng.randint(1, world))
        b = rank % (len(cuts) - 1)
        offsets = [0] * t.dim()
        offsets[dim] = cuts[b]
        local = t.narrow(dim, cuts[b], cuts[b + 1] - cuts[b]).clone()
        return unickpt.ShardedTensor(local, tuple(t.shape), tuple(offsets)), f"blocks {dim} {cuts}"
    if kind == "grid":
        a, b = _factor(rng, world)
        rows, cols = _cuts(rng, t.shape[0], a), _cuts(rng, t.shape[1], b)
        i, j = rank // b, rank % b
        local = t[rows[i] : rows[i + 1], cols[j] : cols[j + 1]].clone()
        offsets = (rows[i], cols[j]) + (0,) * (t.dim() - 2)
        return unickpt.ShardedTensor(local, tuple(t.shape), offsets), f"grid {rows} {cols}"
    cuts = _cuts(rng, t.numel(), world)
    local = t.reshape(-1)[cuts[rank] : cuts[rank + 1]].clone()
    return unickpt.FlatShard(local, tuple(t.shape), cuts[rank]), f"flat {cuts}"


def state(seed: int, rank: int, world: int, loading: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Case ``seed``'s state on this rank (the load's layouts differ from the save's), and a
    description of each key (shape, dtype, layout) for failure messages."""
    rng = random.Random(seed)
    leaves: dict[str, Any] = {}
    told: dict[str, str] = {}
    for i in range(rng.randint(1, 6)):
        t = global_tensor(rng, seed * 100 + i)
        layout_seed = rng.randrange(1 << 30) * (3 if loading else 1)
        leaves[f"k{i}"], how = split(t, layout_seed, rank, world)
        told[f"k{i}"] = f"{tuple(t.shape)} {t.dtype} {how}"
    return leaves, told


def configs(seed: int) -> tuple[unickpt.Config, unickpt.Config]:
    """The save's and the load's engine settings of case ``seed``: checksum segments, windows,
    read pieces and small-chunk bounds from 4 KiB up, 1 to 4 threads, shared reads on or off."""
    rng = random.Random(seed ^ 0x5EED)

    def one() -> unickpt.Config:
        segment = rng.choice((4 << 10, 64 << 10, 1 << 20))
        return unickpt.get_config(
            segment_bytes=segment,
            window_bytes=segment * rng.choice((1, 4, 64)),
            read_piece_bytes=segment * rng.choice((1, 3, 16)),
            small_chunk_bytes=rng.choice((1 << 10, 64 << 10, 1 << 20)),
            io_threads=rng.choice((1, 2, 4)),
            share_reads=rng.random() < 0.7,
        )

    return one(), one()


def blank(leaves: dict[str, Any]) -> None:
    """Every element set to 0 (False), so that an element a load misses shows."""
    for leaf in leaves.values():
        local_of(leaf).zero_()


def differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """The keys whose local values differ bit for bit."""
    out = []
    for k, w in want.items():
        a, b = local_of(w), local_of(got[k])
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            out.append(k)
    return out
