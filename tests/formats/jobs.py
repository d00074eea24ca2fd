"""Rank functions of the format tests (spawned processes import them from here)."""

from __future__ import annotations

import math
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import unickpt


def tp_placement(key: str, t: torch.Tensor) -> Any:
    """Megatron-style tensor parallelism: column-parallel weights split rows, row-parallel
    ones columns, the rest replicated."""
    if t.ndim == 2 and any(p in key for p in ("o_proj", "down_proj")):
        return Shard(1)
    if t.ndim == 2:
        return Shard(0)
    return Replicate()


def _reference(path: str) -> dict[str, torch.Tensor]:
    out = {}
    with safe_open(path, "pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            out[k] = f.get_tensor(k)
    return out


def load_tp(rank: int, world: int, folder: str, single_file: str) -> tuple[int, int, bool]:
    """Load a safetensors model into DTensors split over ``world`` ranks; compare with the file
    read whole; (bytes read, bytes held, all equal)."""
    mesh = init_device_mesh("cpu", (world,))
    ref = _reference(single_file)
    state: dict[str, Any] = {}
    held = 0
    for k, t in ref.items():
        dt = distribute_tensor(torch.zeros_like(t), mesh, [tp_placement(k, t)])
        state["m." + k] = dt
        held += dt.to_local().numel() * t.element_size()
    report = unickpt.load(folder, state, keys=lambda k: "m." + k)
    equal = all(
        torch.equal(state["m." + k].full_tensor().view(torch.uint8), t.view(torch.uint8))
        for k, t in ref.items()
    )
    return report.bytes_read, held, equal and bool(report.unverified_files)


def save_rows(rank: int, world: int, model_file: str, out: str, max_shard: str) -> int:
    """Save a model's state (read from ``model_file``, tied weights kept tied) split by rows
    over ``world`` ranks (FSDP2's layout), as safetensors."""
    mesh = init_device_mesh("cpu", (world,))
    full = torch.load(model_file, weights_only=True)
    made: dict[int, DTensor] = {}
    state: dict[str, Any] = {}
    for k, t in full.items():
        key = t.untyped_storage().data_ptr()
        if key not in made:
            made[key] = distribute_tensor(t, mesh, [Shard(0)] if t.ndim else [Replicate()])
        state[k] = made[key]
    report = unickpt.save(out, state, format="safetensors", max_shard_size=max_shard)
    return report.bytes_written


def bytes_of(state: dict[str, torch.Tensor]) -> int:
    return sum(math.prod(t.shape) * t.element_size() for t in state.values())
