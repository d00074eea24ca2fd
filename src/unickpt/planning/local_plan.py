"""One rank's part of a save's plan: what it declares, and what it writes once all agree.

Before the plans are exchanged, each rank declares its tensors (dtype, shape, layout and the
boxes it holds), its value and per-rank keys and its aliases (:func:`local_plan`), and what it
holds of each :class:`~unickpt.Replicated` tensor (:func:`replica_specs`). Once the global plan
(:mod:`.save_plan`) says which boxes it writes, :func:`views_of` gives their tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.dtypes import dtype_name
from ..layouts.boxes import Box
from .flatten import Flattened
from .save_plan import LocalPlan, TensorDecl, WriteItem


@dataclass(frozen=True)
class ReplicaSpec:
    """What a rank holds of one replicated tensor: its key, shape, dtype and reduction."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    reduce: str


def local_plan(flat: Flattened) -> LocalPlan:
    """This rank's tensors, value keys, per-rank keys and aliases."""
    tensors = {
        k: TensorDecl(dtype_name(t.dtype), t.shape, t.layout, tuple(b for b, _ in t.pieces))
        for k, t in flat.tensors.items()
    }
    return LocalPlan(
        tensors, tuple(sorted(flat.values)), tuple(sorted(flat.per_rank)), dict(flat.aliases)
    )


def replica_specs(flat: Flattened) -> tuple[ReplicaSpec, ...]:
    """This rank's replicated tensors, by key."""
    return tuple(
        ReplicaSpec(k, flat.tensors[k].shape, dtype_name(flat.tensors[k].dtype), reduce)
        for k, reduce in sorted(flat.reductions.items())
    )


def views_of(flat: Flattened, items: tuple[WriteItem, ...]) -> list[torch.Tensor]:
    """The tensor of each item this rank writes: a box it holds, or the rows of one that the
    item is a share of."""
    by_box: dict[tuple[str, Box], torch.Tensor] = {
        (k, b): v for k, t in flat.tensors.items() for b, v in t.pieces
    }
    views = []
    for i in items:
        if i.held is None:
            views.append(by_box[(i.key, i.box)])
        else:
            views.append(by_box[(i.key, i.held)][i.box.relative_to(i.held)])
    return views
