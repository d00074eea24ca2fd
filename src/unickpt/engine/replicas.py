"""Replicated tensors at a save: the copies of the ranks holding one compared, or averaged.

A :class:`~unickpt.Replicated` tensor (a LayerNorm weight every tensor-parallel rank holds) is
reduced across all ranks of the save, every rank taking part (ranks without the key give
nothing): ``reduce="check"`` takes the element-wise maximum and minimum of the copies and fails
the save on every rank, naming the key and the largest difference, where they differ;
``reduce="mean"`` sums the copies and saves their mean. Every rank learns which keys are
replicated, with their shapes, from the save's own planning step, so no exchange is added to a
save without replicated tensors; one with them costs one all-reduce per kind of reduction, of
the replicated tensors' elements (as float64).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..dist import Comm
from ..errors import CheckpointMismatchError
from ..format.dtypes import dtype_name
from ..planning.flatten import Flattened


@dataclass(frozen=True)
class ReplicaSpec:
    """What a rank holds of one replicated tensor: its key, shape, dtype and reduction."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    reduce: str


@dataclass(frozen=True)
class _Agreed:
    spec: ReplicaSpec
    holders: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.spec.shape, dtype=np.int64))


def replica_specs(flat: Flattened) -> tuple[ReplicaSpec, ...]:
    """This rank's replicated tensors, by key."""
    return tuple(
        ReplicaSpec(k, flat.tensors[k].shape, dtype_name(flat.tensors[k].dtype), reduce)
        for k, reduce in sorted(flat.reductions.items())
    )


def reduce_replicas(comm: Comm, flat: Flattened, specs: Sequence[tuple[ReplicaSpec, ...]]) -> None:
    """Check or average this save's replicated tensors; called by every rank with every rank's
    specs (the same on every rank, so every rank raises the same error, or none)."""
    agreed = _agree(specs)
    checks = [a for a in agreed if a.spec.reduce == "check"]
    means = [a for a in agreed if a.spec.reduce == "mean"]
    if checks:
        _check(comm, flat, checks)
    if means:
        _average(comm, flat, means)


def _agree(specs: Sequence[tuple[ReplicaSpec, ...]]) -> list[_Agreed]:
    """Every replicated key with its holders; the holders must describe it alike."""
    first: dict[str, tuple[ReplicaSpec, int]] = {}
    holders: dict[str, list[int]] = {}
    for rank, mine in enumerate(specs):
        for spec in mine:
            known, at = first.setdefault(spec.key, (spec, rank))
            if known != spec:
                raise CheckpointMismatchError(
                    f"Replicated '{spec.key}' is {_describe(spec)} on rank {rank} but "
                    f"{_describe(known)} on rank {at}; every rank holding a replicated tensor "
                    "must hold it with the same shape, dtype and reduce."
                )
            holders.setdefault(spec.key, []).append(rank)
    return [_Agreed(first[k][0], tuple(holders[k])) for k in sorted(first)]


def _describe(spec: ReplicaSpec) -> str:
    return f"{spec.dtype}{list(spec.shape)} with reduce={spec.reduce!r}"


def _values(flat: Flattened, agreed: list[_Agreed], fill: float) -> np.ndarray:
    """This rank's copies as float64, one after the other; ``fill`` where it holds none."""
    parts = []
    for a in agreed:
        leaf = flat.tensors.get(a.spec.key)
        if leaf is None or not leaf.pieces:
            parts.append(np.full(a.numel, fill, dtype=np.float64))
        else:
            ((_, view),) = leaf.pieces
            parts.append(view.detach().to("cpu", torch.float64).reshape(-1).numpy())
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)


def _check(comm: Comm, flat: Flattened, agreed: list[_Agreed]) -> None:
    """Refuse the save where the copies of a key differ: the largest difference of each."""
    x = _values(flat, agreed, -np.inf)
    both = comm.max_across(np.concatenate([x, -_values(flat, agreed, np.inf)]))
    spread = both[: len(x)] + both[len(x) :]  # max - min, element-wise
    bad = []
    start = 0
    for a in agreed:
        part = spread[start : start + a.numel]
        start += a.numel
        if part.size and (np.isnan(part).any() or part.max() > 0):
            where = int(np.nanargmax(part)) if not np.isnan(part).all() else 0
            bad.append((a, float(part[where]), where))
    if bad:
        raise CheckpointMismatchError(_differ_message(bad))


def _differ_message(bad: list[tuple[_Agreed, float, int]]) -> str:
    shown = "; ".join(
        f"'{a.spec.key}' differs by up to {diff:g} between the copies of ranks "
        f"{_ranks(a.holders)} (at element {_element(at, a.spec.shape)})"
        for a, diff, at in bad[:5]
    )
    more = f" (and {len(bad) - 5} more keys)" if len(bad) > 5 else ""
    return (
        f"Replicated(reduce='check'): {shown}{more}. The ranks holding a "
        "replicated tensor must hold the same values; find why they diverged (gradients not "
        "reduced across tensor-parallel ranks), or use reduce='mean' to save their mean. "
        "Nothing was saved."
    )


def _element(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat_index, shape)) if shape else ()


def _ranks(ranks: tuple[int, ...]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (" ..." if len(ranks) > 8 else "")


def _average(comm: Comm, flat: Flattened, agreed: list[_Agreed]) -> None:
    """Replace this rank's copy of each key, for the save only, by the mean of all copies."""
    total = comm.sum_across(_values(flat, agreed, 0.0))
    start = 0
    for a in agreed:
        part = total[start : start + a.numel]
        start += a.numel
        leaf = flat.tensors.get(a.spec.key)
        if leaf is None or not leaf.pieces:
            continue
        ((box, view),) = leaf.pieces
        mean = torch.from_numpy(part / len(a.holders)).reshape(a.spec.shape)
        leaf.pieces = [(box, mean.to(view.dtype))]
