"""New leaves of the layout of given ones, made without communication."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

import unickpt


def filled_like(leaf: Any, value: float) -> Any:
    """A new leaf of ``leaf``'s layout (its mesh and placements, its box or flat range), every
    element ``value``. Unlike making the layout again (``distribute_tensor`` is a collective),
    this costs no communication, so a test can make fresh destinations for many loads."""
    if isinstance(leaf, DTensor):
        local = torch.full_like(leaf.to_local(), value)
        return DTensor.from_local(
            local, leaf.device_mesh, leaf.placements, shape=leaf.shape, stride=leaf.stride()
        )
    if isinstance(leaf, unickpt.ShardedTensor):
        local = torch.full_like(leaf.local, value)
        return unickpt.ShardedTensor(local, leaf.global_shape, leaf.offsets)
    if isinstance(leaf, unickpt.FlatShard):
        return unickpt.FlatShard(
            torch.full_like(leaf.local, value), leaf.global_shape, leaf.flat_offset
        )
    return torch.full_like(leaf, value)
