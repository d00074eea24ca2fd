"""The plan phase of a save (:func:`plan`): the planned save, what a target may hold, the
agreed global plan.

Each rank flattens its state,
replaces quantized tables by their stored rows, encodes its plain values and declares its
local plan (:mod:`unickpt.planning.local_plan`), packed by kinds; the coordinator meanwhile
takes the lock, checks what the target holds (:func:`check_replaceable`) and draws the save's
id. Then :func:`agree`: when every rank's structure is that of the plan every rank has cached
(and no rank holds Replicated tensors), one all-reduce of five integers says so and the
coordinator broadcasts the save's id; otherwise every rank's description is all-gathered,
Replicated tensors are checked or averaged (:mod:`.replicas`), and the global plan is built
(pure, on every rank; :mod:`unickpt.planning.save_plan`) from plans whose shared tables and
kinds are broadcast once each. A failure on one rank raises on every rank.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..dist import Comm, RankFailure, failure_of, on_reset, raise_failures, run_step
from ..encoding.rowwise import ErrorSums
from ..encoding.saving import EncodedTable, encode_leaves, written_errors
from ..engine.commit import read_commit
from ..engine.references import dependents
from ..errors import CheckpointError, CheckpointExistsError
from ..format.values import encode_value
from ..planning.flatten import flatten_state, rename_for_save
from ..planning.local_plan import local_plan, replica_specs, views_of
from ..planning.packed import (
    PackedPlan,
    first_holders,
    shared_parts,
    with_shared,
    without_shared,
)
from ..planning.save_plan import GlobalPlan, WriteItem, build_global_plan
from ..storage.base import Storage
from .replicas import reduce_replicas
from .save import Save


@dataclass(frozen=True)
class _CachedPlan:
    """The plan of the last structure saved, with this rank's signature, its rank among how
    many, and the share size it was made with."""

    plan: GlobalPlan
    signature: str
    rank: int
    world_size: int
    share_bytes: int


_PLAN_CACHE: dict[str, _CachedPlan] = {}
on_reset(_PLAN_CACHE.clear)  # a plan of the job's old membership is never offered again


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


def plan(save: Save, state: dict[str, Any], failed: Exception | None = None) -> PlannedSave:
    """Phase 2, on every rank together (see the module's docstring): flatten, encode, agree on the
    plan (cached while the structure is unchanged). On failure nothing was written and no
    lock is left held. ``lock=False``: the caller holds a lock that covers the target (a
    Checkpointer holds its root's), so the save takes none of its own. ``keys`` renames the
    state's keys to the saved ones (:func:`rename_for_save`). ``failed``: what
    failed on this rank before the save (a zero-stall save's capture), raised in the planning
    step, so that every rank raises it instead of waiting for this one."""
    t0 = time.perf_counter()
    comm, storage, o = save.comm, save.storage, save.options
    held: list[Callable[[], None]] = []
    encoded: dict[str, EncodedTable] = {}
    state_keys: dict[str, str] = {}

    def describe() -> tuple[Any, Any]:
        if failed is not None:
            raise failed
        renamed = rename_for_save(flatten_state(state, layout=o.layout), o.keys)
        flat = renamed.flat
        state_keys.update(renamed.state_keys)
        # Every rank encodes its values (in parallel, so no slower than one rank doing
        # it) and learns from the plan which of them it sends: the lowest rank holding a
        # key does.
        values = {k: encode_value(v.value, k, o.allow_pickle) for k, v in flat.values.items()}
        per_rank = {k: encode_value(v.value, k, o.allow_pickle) for k, v in flat.per_rank.items()}
        if o.quantize:
            encoded.update(encode_leaves(flat, o.quantize))
        specs, packed = replica_specs(flat), local_plan(flat).packed()
        extra = None
        if comm.is_coordinator:
            if o.lock:
                held.append(storage.acquire_lock())
            if read_commit(storage) is not None:
                check_replaceable(storage, o.overwrite)
            extra = (uuid.uuid4().hex[:12], save.config.replica_share_bytes)
        ids = (packed.table_id, packed.kinds_id)
        cached = next(iter(_PLAN_CACHE), None)  # the key of the plan of the last save
        shared = (packed.signature(), cached, extra, ids, specs)
        return (flat, packed, values, per_rank), shared

    local: Any = None
    mine: Any = None
    failure: RankFailure | None = None
    caught: BaseException | None = None
    try:
        try:
            local, mine = describe()
        except Exception as e:  # noqa: BLE001 - reported to every rank by agree
            failure, caught = failure_of(comm.rank, e), e
        save_id, global_plan, cached = agree(comm, local, mine, failure, caught)
    except BaseException:
        for undo in held:
            undo()
        raise
    flat, _, values, per_rank = local
    items = global_plan.writes(comm.rank)
    views = views_of(flat, items)
    sent = {k: values[k] for k in global_plan.values_of(comm.rank)}
    return PlannedSave(
        comm,
        save_id,
        global_plan,
        items,
        views,
        sent,
        per_rank,
        cached,
        held[0] if held else None,
        encoded,
        written_errors(items, encoded),
        time.perf_counter() - t0,
        state_keys,
    )


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


def agree(
    comm: Comm,
    local: Any,
    mine: Any,
    failure: RankFailure | None,
    caught: BaseException | None,
) -> tuple[str, GlobalPlan, bool]:
    """The save's id, the global plan, and whether it was the cached one. ``local``: this
    rank's (flattened state, packed plan, ...); ``mine``: its description (signature, cached
    key, the coordinator's (save id, share size), table and kinds digests, replica specs);
    ``failure``: what failed on this rank while describing (raised on every rank)."""
    reused = _reused_plan(comm, mine if failure is None else None)
    if reused is not None:
        (save_id, _), plan = reused
        return save_id, plan, True
    gathered = comm.all_gather((failure, mine))
    raise_failures(comm, "planning the save", [f for f, _ in gathered], caught)
    shared = [s for _, s in gathered]
    save_id, share_bytes = shared[0][2]
    signatures = (*(s for s, *_ in shared), str(share_bytes))
    key = hashlib.blake2b(repr(signatures).encode(), digest_size=16).hexdigest()
    cached = all(c == key for _, c, *_ in shared)
    reduce_replicas(comm, local[0], [r for *_, r in shared])  # Replicated tensors, if any
    entry = _PLAN_CACHE.get(key) if cached else None
    if entry is None:
        plan = _agree_on_plan(comm, local[1], [s[3] for s in shared], share_bytes)
        entry = _CachedPlan(plan, mine[0], comm.rank, comm.world_size, share_bytes)
        _PLAN_CACHE.clear()
        _PLAN_CACHE[key] = entry
    return save_id, entry.plan, cached


def _reused_plan(comm: Comm, mine: Any) -> tuple[tuple[str, int], GlobalPlan] | None:
    """The coordinator's (save id, share size) and the cached plan, where every rank described
    its state (``mine``, None where it failed) with the structure, and at the rank, of the plan
    every rank has cached, the coordinator with the same share size, and no rank holds
    Replicated tensors (their copies are compared by the full exchange); else None. Ranks that
    all cached one plan, of as many ranks as they are, each at its rank then, are the ranks
    that made it. One all-reduce of five integers and one broadcast: a save of an unchanged
    structure exchanges as much per rank at any world size."""
    entry = _PLAN_CACHE.get(mine[1]) if mine is not None and mine[1] is not None else None
    fresh = (
        entry is not None
        and entry.signature == mine[0]
        and (entry.rank, entry.world_size) == (comm.rank, comm.world_size)
        and not mine[4]
        and (mine[2] is None or mine[2][1] == entry.share_bytes)
    )
    key = (int(mine[1][:15], 16), int(mine[1][15:30], 16)) if fresh else (0, 0)
    agreed = comm.max_across(np.array([not fresh, *key, -key[0], -key[1]], dtype=np.int64))
    if agreed[0] or agreed[1] != -agreed[3] or agreed[2] != -agreed[4]:
        return None
    assert entry is not None
    return comm.broadcast(mine[2]), entry.plan


def _agree_on_plan(
    comm: Comm, plan: PackedPlan, ids: list[tuple[bytes, bytes]], share_bytes: int
) -> GlobalPlan:
    """Exchange the local plans and build the global one. Pure and run on every rank over the
    same plans; run_step still gathers the outcome, so that a rank failing alone (out of
    memory) cannot leave the others waiting."""
    plans = _exchange_plans(comm, plan, ids)
    built, _ = run_step(
        comm, "planning the save", lambda: (build_global_plan(plans, share_bytes), None)
    )
    return built


def _exchange_plans(
    comm: Comm, plan: PackedPlan, ids: list[tuple[bytes, bytes]]
) -> list[PackedPlan]:
    """Every rank's plan. Ranks split alike send equal tables and kinds (``ids``: their
    digests, already exchanged): each distinct one is broadcast once by the first rank holding
    it, and the plans are all-gathered without them, so a rank receives a few rows per rank
    rather than every rank's table."""
    owners = first_holders(ids)
    gathered = comm.all_gather(without_shared(plan))
    parts: dict[bytes, Any] = {}
    for src in sorted(set(owners.values())):
        sent = shared_parts(plan, owners, src) if src == comm.rank else {}
        parts.update(comm.broadcast(sent, src))
    return [with_shared(p, parts) for p in gathered]
