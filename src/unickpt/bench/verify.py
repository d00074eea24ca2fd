"""Digests of a whole training state, to check that a load restored every element in its place.

Every tensor is digested as its global value: a sharded tensor (DTensor) is gathered whole,
one at a time, and one rank (its turn by position) hashes the dtype, the shape and every byte
with xxh3-128; a plain tensor (AdamW's ``step``) is hashed on every rank and keyed by rank.
The digests are the same for any layout of the same values, and differ as soon as one element
differs or a block sits in the wrong place. Extra memory: the largest tensor, gathered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import xxhash

from unickpt.bench.model import TrainState

Digest = dict[str, str]


def named_tensors(state: TrainState) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the state, in an order that does not depend on the layout: parameters
    by name, each followed by its optimizer tensors in key order."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, param in state.model.named_parameters():
        out.append((name, param))
        for key, value in sorted(state.optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                out.append((f"{name}.{key}", value))
    return out


def _hash(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().cpu()
    digest = xxhash.xxh3_128(f"{data.dtype}{tuple(data.shape)}".encode())
    digest.update(data.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def state_digest(state: TrainState) -> Digest:
    """Collective: the digest of every tensor of ``state``; every rank gets the whole dict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local: Digest = {}
    with torch.no_grad():
        for index, (name, tensor) in enumerate(named_tensors(state)):
            full_tensor = getattr(tensor, "full_tensor", None)
            if callable(full_tensor):
                whole = full_tensor()
                if index % world == rank:
                    local[name] = _hash(whole)
                del whole
            else:
                local[f"{name}@rank{rank}"] = _hash(tensor)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local)
    merged: Digest = {}
    for part in gathered:
        merged.update(part)
    return merged


def mismatches(expected: Digest, actual: Digest) -> list[str]:
    """Names whose digests differ, plus names missing on either side, sorted."""
    return sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))


def perturb(state: TrainState) -> None:
    """Overwrite every parameter and optimizer tensor, so that a load that skips one is caught."""
    with torch.no_grad():
        for _, tensor in named_tensors(state):
            if tensor.is_floating_point():
                tensor.mul_(0.5).add_(1.0)
            else:
                tensor.add_(1)
