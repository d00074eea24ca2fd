"""The plan phase's parts: the planned save, what a target may hold, the agreed global plan.

The phase itself (:meth:`unickpt.saving.pipeline.Save.plan`): each rank flattens its state,
replaces quantized tables by their stored rows, encodes its plain values and declares its
local plan (:mod:`unickpt.planning.local_plan`); the coordinator meanwhile takes the lock,
checks what the target holds (:func:`check_replaceable`) and draws the save's id. Every rank
sends a 16-byte digest of its packed plan: when all match the cached plan, it is reused and
nothing else is exchanged; otherwise the packed plans are all-gathered and the global plan is
built (pure, on every rank; :mod:`unickpt.planning.save_plan`) (:func:`agreed_plan`).
Replicated tensors are checked or averaged in between (:mod:`.replicas`). What can fail on
one rank goes through ``run_step``, so every rank raises together or goes on together.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dist import Comm, run_step
from ..encoding.rowwise import ErrorSums
from ..encoding.saving import EncodedTable
from ..engine.references import dependents
from ..errors import CheckpointError, CheckpointExistsError
from ..planning.packed import PackedPlan
from ..planning.save_plan import GlobalPlan, WriteItem, build_global_plan
from ..storage.base import Storage

_PLAN_CACHE: dict[str, GlobalPlan] = {}


@dataclass
class PlannedSave:
    """What one rank needs after planning: its items and their views (the tensors' bytes), the
    encoded values it sends at the commit (its plain values by the plan, and its per-rank
    values), and the lock to release once the save ends."""

    comm: Comm
    save_id: str
    plan: GlobalPlan
    items: tuple[WriteItem, ...]
    views: list[torch.Tensor]
    values: dict[str, Any]
    per_rank: dict[str, Any]
    plan_cached: bool
    release: Callable[[], None] | None = None
    encoded: dict[str, EncodedTable] = field(default_factory=dict)
    encoding_errors: dict[str, ErrorSums] = field(default_factory=dict)
    plan_s: float = 0.0
    """Seconds the plan phase took (flattening, encoding, agreeing on the plan)."""
    state_keys: dict[str, str] = field(default_factory=dict)
    """The state's key of each saved key that ``keys=`` renamed."""

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    def state_key(self, key: str) -> str:
        return self.state_keys.get(key, key)

    @property
    def file_bytes(self) -> int:
        """The size of this rank's data file (its items and the padding between them)."""
        return self.items[-1].byte_offset + self.items[-1].nbytes if self.items else 0


def check_replaceable(storage: Storage, overwrite: bool) -> None:
    """A committed checkpoint is replaced only when asked to, and never while other
    checkpoints' incremental saves refer to its bytes (the replacement deletes them)."""
    if not overwrite:
        raise CheckpointExistsError(
            f"{storage.location} already holds a committed checkpoint; pass overwrite=True to "
            "replace it (the old one stays loadable until the new one is committed), or save to "
            "a new path."
        )
    referring = dependents(storage)
    if referring:
        raise CheckpointError(
            f"{storage.location} holds a committed checkpoint whose bytes the incremental "
            f"checkpoints in {', '.join(referring)} refer to; replacing it would break them. "
            "Save under a new step, or delete those checkpoints first. Nothing was written."
        )


def cached_plan_key() -> str | None:
    """The key of the plan kept from the last save (None before the first)."""
    return next(iter(_PLAN_CACHE), None)


def agreed_plan(
    comm: Comm, packed: PackedPlan, shared: list[tuple[Any, ...]]
) -> tuple[GlobalPlan, bool]:
    """The global plan, and whether it was the cached one: reused when every rank's digest
    matches the cache, else built from the all-gathered plans. Building is pure and run on
    every rank over the same plans; run_step still gathers the outcome, so that a rank failing
    alone (out of memory) cannot leave the others waiting."""
    key = hashlib.blake2b(repr(tuple(s for s, *_ in shared)).encode(), digest_size=16).hexdigest()
    cached = all(c == key for _, c, *_ in shared)
    found = _PLAN_CACHE.get(key) if cached else None
    if found is not None:
        return found, True
    plans = comm.all_gather(packed)

    def build() -> tuple[GlobalPlan, None]:
        return build_global_plan(plans), None

    built, _ = run_step(comm, "planning the save", build)
    _PLAN_CACHE.clear()
    _PLAN_CACHE[key] = built
    return built, cached
