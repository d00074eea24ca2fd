"""32 ranks as 8 nodes of 4 on this machine: a tiny state saved, then loaded at 32, 24 and 8
ranks into other layouts, every value checked bitwise (and a replicated state saved by 32, then
16, then 8 of them, loaded back); and what a save exchanges per rank (its
collectives and bytes) at 8, 16 and 32 ranks, which must not grow with the ranks beyond what the
data needs: a save whose plan is cached sends and receives as much on a rank of 32 as of 8 (the
coordinator receives each rank's report)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import unickpt
from tests.distributed import run_ranks
from unickpt.dist import traffic

WORLD, NODE = 32, 4
LOADS = (32, 24, 8)
SAVES = (8, 16, 32)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(32)
    return {
        "w": torch.randn(96, 5, generator=g),  # rows split over the ranks
        "flat": torch.randn(7, 11, generator=g).to(torch.bfloat16),  # uneven flat ranges
        "norm": torch.randn(6, generator=g),  # held whole by every rank
    }


def _state(rank: int, world: int, step: int) -> dict[str, Any]:
    t = _tensors()
    rows = 96 // world
    w = unickpt.ShardedTensor(
        t["w"][rank * rows : (rank + 1) * rows].clone(), (96, 5), (rank * rows, 0)
    )
    n = t["flat"].numel()
    lo, hi = n * rank // world, n * (rank + 1) // world
    flat = unickpt.FlatShard(t["flat"].reshape(-1)[lo:hi].clone(), (7, 11), lo)
    return {"w": w, "flat": flat, "norm": t["norm"].clone(), "step": step}


def _emptied(state: dict[str, Any]) -> dict[str, Any]:
    w, flat = state["w"], state["flat"]
    return {
        "w": unickpt.ShardedTensor(torch.full_like(w.local, -7), w.global_shape, w.offsets),
        "flat": unickpt.FlatShard(torch.full_like(flat.local, -7), (7, 11), flat.flat_offset),
        "norm": torch.full_like(state["norm"], -7),
        "step": -1,
    }


def _wrong(loaded: dict[str, Any], want: dict[str, Any]) -> list[str]:
    wrong = [k for k in ("w", "flat") if not torch.equal(loaded[k].local, want[k].local)]
    wrong += [] if torch.equal(loaded["norm"], want["norm"]) else ["norm"]
    return wrong + ([] if loaded["step"] == want["step"] else ["step"])


def _rank(
    rank: int, world: int, root: str, saves: tuple[int, ...], loads: tuple[int, ...]
) -> dict[str, Any]:
    """Saves at each of ``saves`` ranks (the first ``n``), twice, what they exchanged; loads of
    the save at ``world`` ranks at each of ``loads`` ranks, what was wrong. The groups of the
    first ``n`` ranks are made from the largest down, each by its members only, when first
    used: torch names such a group by how many groups each member knows, so members must all
    know the same groups."""
    os.environ.update(UNICKPT_NODE=f"node-{rank // NODE}", LOCAL_WORLD_SIZE=str(NODE))
    exchanged: dict[int, list[tuple[int, int, int]]] = {}
    wrong = {}
    for n in sorted({*saves, *loads}, reverse=True):
        if rank >= n:
            continue
        group = dist.new_group(list(range(n)), use_local_synchronization=True)
        if n in saves:  # the structure the larger group saved last: planned again, not reused
            wrong[-n] = _replicated_wrong(f"{root}/r{n}", group)
        for step in (1, 2) if n in saves else ():  # the first save plans, the second reuses
            before = traffic()
            unickpt.save(f"{root}/s{n}", _state(rank, n, step), group=group, overwrite=True)
            used = traffic() - before
            exchanged.setdefault(n, []).append(
                (used.collectives, used.bytes_sent, used.bytes_received)
            )
        if n in loads:
            want = _state(rank, n, 2)
            loaded = _emptied(want)
            unickpt.load(f"{root}/s{world}", loaded, group=group)
            wrong[n] = _wrong(loaded, want)
        if n in saves:
            wrong[-n] += _replicated_wrong(f"{root}/r{n}", group)
    return {"exchanged": exchanged, "wrong": wrong}


def _replicated_wrong(path: str, group: Any) -> list[str]:
    """Save tensors every rank holds whole (the same structure at any world size) and load
    them back: the keys whose values differ."""
    replicated = {f"r{i}": torch.full((3,), float(i)) for i in range(WORLD - 8)}
    unickpt.save(path, replicated, group=group, overwrite=True)
    loaded = {k: torch.zeros(3) for k in replicated}
    unickpt.load(path, loaded, group=group)
    return [k for k, v in replicated.items() if not torch.equal(loaded[k], v)]


def test_32_ranks_save_and_load_at_32_24_and_8_and_exchange_per_rank(tmp_path: Path) -> None:
    results = run_ranks(WORLD, _rank, str(tmp_path), SAVES, LOADS, timeout_s=600)
    for rank, r in enumerate(results):
        assert r["wrong"] == {n: [] for n in (*LOADS, *(-s for s in SAVES)) if rank < abs(n)}
    rows = []
    for n in SAVES:
        first, cached = zip(*(r["exchanged"][n] for r in results[:n]))
        # every rank takes part in the same collectives
        assert len({c for c, _, _ in first}) == 1 and len({c for c, _, _ in cached}) == 1
        rows.append((n, first, cached))
    print("\nranks | save | collectives | bytes sent/received, coordinator | other ranks (max)")
    for n, first, cached in rows:
        for name, per_rank in (("first", first), ("cached", cached)):
            others = per_rank[1:]
            print(
                f"{n} | {name} | {per_rank[0][0]} | {per_rank[0][1]}/{per_rank[0][2]} | "
                f"{max(s for _, s, _ in others)}/{max(r for _, _, r in others)}"
            )
    # A save of an unchanged structure: the same collectives at any world size, and no rank
    # but the coordinator (which gathers every rank's report) receives or sends more at 32
    # ranks than at 8.
    small, large = rows[0][2], rows[-1][2]
    assert small[0][0] == large[0][0]
    assert max(x[1] for x in large[1:]) <= max(x[1] for x in small[1:])
    assert max(x[2] for x in large[1:]) <= max(x[2] for x in small[1:])
