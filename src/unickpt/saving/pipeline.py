"""A save: one object (:class:`Save`) that passes through its phases in order.

1. **capture** (zero-stall only, :func:`unickpt.planning.capture.capture`): the state as it is
   at the call; large tensors kept by reference, their version counters recorded.
2. **plan** (:func:`plan`, :mod:`.plan`): flatten, encode, agree with every rank on the
   global plan.
3. **copy** (:func:`copy`): the bytes this rank writes, into the staging memory its turn in
   the save queue lends it (:mod:`.queue`): a whole snapshot when they fit the budget, else a
   bounded ring of the budget's size (:mod:`unickpt.engine.ring`), else none (compressed and
   incremental saves above the budget write from the live tensors).
4. **write** (:func:`write`, :mod:`.write`): this rank's data file and index.
5. **commit** (:func:`commit`, :mod:`.commit`): every rank's outcome gathered, metadata and
   marker written by the coordinator, then ``on_commit`` on every rank.

Each phase takes the save and what the phase before left (frozen records: the planned save,
the copy, what was written). Every way to save builds the same :class:`Save` and runs it with
:func:`run`; the modes differ only in which phases run in the call and which in the
background:

============== ====================== =====================================================
mode           in the call            in the background
============== ====================== =====================================================
``sync``       plan, write, commit    nothing
``async``      plan, copy             write, commit (all in the call when there is no copy)
``zero_stall`` capture                plan, copy, write, commit; every optimizer step of the
                                      process waits for the copy (:mod:`unickpt.engine.hold`)
============== ====================== =====================================================
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..dist import Comm, RankFailure, failure_of
from ..encoding.saving import EncodedTable, encode_leaves, written_errors
from ..engine.commit import read_commit
from ..engine.futures import SaveFuture, SaveReport
from ..engine.hold import hold_steps
from ..engine.incremental import IncrementalSave
from ..engine.ring import Stager
from ..engine.snapshot import snapshot, stream_marker
from ..engine.sources import ItemSource, needs_pinned
from ..engine.timeline import Timeline
from ..errors import CheckpointError
from ..format.values import encode_value
from ..layouts.rules import LayoutMap
from ..planning.capture import Capture, capture
from ..planning.flatten import flatten_state
from ..planning.load_keys import KeyMap
from ..planning.local_plan import local_plan, replica_specs, views_of
from ..planning.save_keys import rename_for_save
from ..planning.save_plan import CHUNK_ALIGN
from ..storage.base import Storage
from .commit import Written, commit_save
from .plan import PlannedSave, agree, cached_plan_key, check_replaceable
from .queue import QUEUE
from .write import write_rank_files

log = logging.getLogger(__name__)

MODES = ("sync", "async", "zero_stall")
"""How a save runs: see the module's table."""


@dataclass(frozen=True)
class SaveOptions:
    """What a save was asked to do, beyond its target and state (see :func:`unickpt.save`
    and :func:`unickpt.async_save`). ``staging_bytes`` None: the config's budget."""

    allow_pickle: bool = False
    overwrite: bool = False
    quantize: dict[str, int] | None = None
    compress: bool = False
    lock: bool = True
    layout: LayoutMap | None = None
    keys: KeyMap | None = None
    staging_bytes: int | None = None
    incremental: IncrementalSave | None = None
    on_commit: Callable[[], None] | None = None
    progress: Callable[[int, int], None] | None = None


@dataclass(frozen=True)
class Copy:
    """Where phase 3 left the bytes this rank writes: ``sources``, what the write reads (the
    copy, or the live tensors); ``stager``, the bounded ring the write's parts come through;
    ``check``, run before and after the write, raising to fail it on every rank."""

    sources: list[ItemSource]
    stager: Stager | None = None
    check: Callable[[], None] | None = None


class Save:
    """One save on this rank, from its call to its commit: where it goes, how, its process
    group, its turn in the save queue and its future. The phases below take it and what the
    phase before left. Made in the caller's thread on every rank (it may create the save's
    process group), it takes its turn at once: saves run in the order they were called."""

    def __init__(self, storage: Storage, group: Any, config: Config, options: SaveOptions) -> None:
        self.storage = storage
        self.config = config
        self.options = options
        self.budget = staging_budget(options.staging_bytes, config)
        self.comm = Comm(group, config.collective_timeout_s)
        future = SaveFuture()
        future.path = storage.location
        self.turn = QUEUE.admit(future)
        self.future = future


def plan(save: Save, state: dict[str, Any], failed: Exception | None = None) -> PlannedSave:
    """Phase 2, on every rank together (see :mod:`.plan`): flatten, encode, agree on the
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
        if o.quantize:
            encoded.update(encode_leaves(flat, o.quantize))
        specs, packed = replica_specs(flat), local_plan(flat).packed()
        # Every rank encodes its values (in parallel, so no slower than one rank doing
        # it) and learns from the plan which of them it sends: the lowest rank holding a
        # key does.
        values = {k: encode_value(v.value, k, o.allow_pickle) for k, v in flat.values.items()}
        per_rank = {k: encode_value(v.value, k, o.allow_pickle) for k, v in flat.per_rank.items()}
        extra = None
        if comm.is_coordinator:
            if o.lock:
                held.append(storage.acquire_lock())
            if read_commit(storage) is not None:
                check_replaceable(storage, o.overwrite)
            extra = (uuid.uuid4().hex[:12], save.config.replica_share_bytes)
        ids = (packed.table_id, packed.kinds_id)
        shared = (packed.signature(), cached_plan_key(), extra, ids, specs)
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


def stages(save: Save, planned: PlannedSave) -> bool:
    """Whether phase 3 copies: the bytes fit the budget, or a bounded ring can take them
    (a plain full write: a compressed or incremental one reads each tensor more than once,
    or out of file order)."""
    o, ring = save.options, 2 * save.config.segment_bytes
    small = planned.nbytes <= save.budget
    return small or (not o.compress and o.incremental is None and save.budget >= ring)


def copy(
    save: Save,
    planned: PlannedSave,
    captured: Capture | None = None,
    intra_op: bool = False,
    marker: Any = None,
) -> Copy:
    """Phase 3. With ``captured`` (zero-stall), each tensor is checked unchanged since the
    call once copied (or, without a copy, before and after the write); ``marker``, a CUDA
    event the copy waits for. Never raises: a failure becomes a check that fails the
    write, so that every rank learns of it."""
    views, items = planned.views, planned.items
    keys = [planned.state_key(i.key) for i in items]  # as the capture knows them
    check_item = None if captured is None else _checking(captured, keys)
    failed: Exception | None = None
    try:
        if marker is not None:
            marker.synchronize()
        if not stages(save, planned):  # the write reads the live tensors
            check = None if captured is None else lambda: captured.check_all(keys)
            return Copy(_live(planned), check=check)
        small = planned.nbytes <= save.budget
        room = save.turn.room(planned.file_bytes if small else save.budget, needs_pinned(views))
        if not small:
            done = save.future.set_snapshot_done
            return Copy(_live(planned), Stager(views, room, check_item, on_copied=done))
        sources = snapshot(items, views, room, save.config.io_threads, check_item, intra_op)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the write
        sources, failed = [], e
    save.future.set_snapshot_done()
    return Copy(sources, check=None if failed is None else _raising(failed))


def write_and_commit(save: Save, planned: PlannedSave, copied: Copy) -> SaveReport:
    """Phases 4 and 5, on every rank together; raise everywhere when any rank failed."""
    timeline = Timeline()
    timeline.add("plan", planned.plan_s)
    written = write(save, planned, copied, timeline)
    return commit(save, planned, written, timeline)


def write(save: Save, planned: PlannedSave, copied: Copy, timeline: Timeline) -> Written:
    """Phase 4: this rank's files, or the error that stopped them."""
    o = save.options
    t0 = time.perf_counter()
    ref, error = None, None
    try:
        if copied.check is not None:
            copied.check()
        if planned.items:
            ref = write_rank_files(
                save.storage,
                planned,
                copied.sources,
                save.config,
                o.incremental,
                o.compress,
                o.progress,
                copied.stager,
                timeline,
            )
        if copied.check is not None:
            copied.check()
    except Exception as e:  # noqa: BLE001 - reported to every rank
        error = e
    finally:
        if copied.stager is not None:
            copied.stager.stop()  # the snapshot is over, whatever happened
    return Written(ref, error, time.perf_counter() - t0)


def commit(save: Save, planned: PlannedSave, written: Written, timeline: Timeline) -> SaveReport:
    """Phase 5, then ``on_commit``."""
    o = save.options
    report = commit_save(
        planned, save.storage, written, save.config, o.compress, o.incremental, timeline
    )
    if o.on_commit is not None:
        o.on_commit()
    return report


def run(save: Save, state: dict[str, Any], mode: str) -> SaveFuture:
    """Run ``save`` of ``state`` in ``mode``; its future (done already for ``sync``)."""
    if mode == "zero_stall":
        _start_zero_stall(save, state)
    else:
        _plan_in_call(save, state, mode)
    save.future.blocking_s = time.perf_counter() - save.future.started_s
    return save.future


def _plan_in_call(save: Save, state: dict[str, Any], mode: str) -> None:
    """Sync and async: plan in the call, after every earlier save; then write and commit in
    the call, or copy in the call and write and commit in the background."""
    try:
        save.turn.wait()
        planned = plan(save, state)
    except BaseException as e:
        save.turn.end(error=e)
        raise
    if mode == "sync" or not stages(save, planned):
        if mode != "sync":
            log.info("%d bytes exceed the staging budget; saving in the call", planned.nbytes)
        _finish_in_call(save, planned)
        return
    try:
        copied = copy(save, planned, intra_op=True)  # the caller waits: torch's threads help
        save.turn.run_in_background(lambda: write_and_commit(save, planned, copied))
    except BaseException as e:  # interrupted in the call: nothing runs on, nothing stays held
        if planned.release is not None:
            planned.release()
        save.turn.end(error=e)
        raise
    if copied.stager is not None:
        copied.stager.wait_copied()


def _finish_in_call(save: Save, planned: PlannedSave) -> None:
    try:
        report = write_and_commit(save, planned, Copy(_live(planned)))
    except BaseException as e:
        save.turn.end(error=e)
        raise
    save.turn.end(report)


def _start_zero_stall(save: Save, state: dict[str, Any]) -> None:
    """Capture in the call; plan, copy, write and commit in the background, in turn, while
    every optimizer step of the process waits for the copy."""
    captured: Capture | None = None
    failed: Exception | None = None
    try:
        captured = capture(state)
    except Exception as e:  # noqa: BLE001 - raised in the planning step, on every rank
        failed = e
    except BaseException as e:
        save.turn.end(error=e)
        raise
    marker = stream_marker()  # CUDA: the copy starts after the caller's queued kernels
    hold_steps(save.future)

    def work() -> SaveReport:
        planned = plan(save, {} if captured is None else captured.state, failed)
        copied = copy(save, planned, captured, marker=marker)
        return write_and_commit(save, planned, copied)

    save.turn.run_in_background(work)


def _live(planned: PlannedSave) -> list[ItemSource]:
    """The tensors themselves, as the write's sources."""
    return [ItemSource(v) for v in planned.views]


def prepare_staging(
    state: dict[str, Any], config: Config, staging_bytes: int | None, layout: LayoutMap | None
) -> SaveFuture:
    """Allocate ahead, in turn, the staging memory a save of ``state`` copies into: room for
    every piece this rank holds (an upper bound of its file, which the plan may make smaller),
    at most the budget."""
    budget = staging_budget(staging_bytes, config)
    flat = flatten_state(state, layout=layout)
    views = [v for t in flat.tensors.values() for _, v in t.pieces]
    upper = sum(-(-v.numel() * v.element_size() // CHUNK_ALIGN) * CHUNK_ALIGN for v in views)
    return QUEUE.prepare(min(upper, budget), needs_pinned(views))


def staging_budget(staging_bytes: int | None, cfg: Config) -> int:
    """``staging_bytes`` checked, or the config's budget."""
    if staging_bytes is None:
        return cfg.staging_budget_bytes
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int):
        raise CheckpointError(
            f"staging_bytes is {staging_bytes!r}; expected a number of bytes (an int) or None "
            "for the config's staging_budget_bytes."
        )
    if staging_bytes < 2 * cfg.segment_bytes:
        raise CheckpointError(
            f"staging_bytes is {staging_bytes}; expected at least two checksum segments "
            f"({2 * cfg.segment_bytes} bytes). A budget of a few parts (64 MiB or more) keeps "
            "copies and writes overlapped."
        )
    return staging_bytes


def _checking(captured: Capture, keys: list[str]) -> Callable[[int], None]:
    """A check of item ``i``'s tensor: unchanged since the call."""
    return lambda i: captured.check(keys[i])


def _raising(error: Exception) -> Callable[[], None]:
    def fail() -> None:
        raise error

    return fail
