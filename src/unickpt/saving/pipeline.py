"""A save: one object (:class:`.save.Save`) that passes through its phases in order, one
module each.

1. **capture** (zero-stall only, :func:`unickpt.planning.capture.capture`): the state as it is
   at the call; large tensors kept by reference, their version counters recorded.
2. **plan** (:func:`.plan.plan`): flatten, encode, agree with every rank on the global plan.
3. **copy** (:func:`.copy.copy`): the bytes this rank writes, into the staging memory its turn in
   the save queue lends it (:mod:`.queue`): a whole snapshot when they fit the budget, else a
   bounded ring of the budget's size (:mod:`unickpt.engine.ring`), else none (compressed and
   incremental saves above the budget write from the live tensors).
4. **write** (:func:`.write.write`): this rank's data file and index.
5. **commit** (:func:`.commit.commit`): every rank's outcome gathered, metadata and marker
   written by the coordinator, then ``on_commit`` on every rank.

Each phase takes the save and what the phase before left (frozen records: the planned save,
the copy, what was written). Every way to save builds the same ``Save`` and runs it with
:func:`run`, through one sequence of phases (:func:`phases`); the modes differ only in which
phases run in the call and which in the background:

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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..config import Config
from ..engine.futures import SaveFuture, SaveReport
from ..engine.hold import hold_steps
from ..engine.snapshot import stream_marker
from ..engine.sources import needs_pinned
from ..layouts.rules import LayoutMap
from ..planning.capture import capture
from ..planning.flatten import flatten_state
from ..planning.save_plan import CHUNK_ALIGN
from .commit import commit
from .copy import Copy, copy, live, stages
from .plan import PlannedSave, plan
from .queue import QUEUE
from .save import Save, staging_budget
from .write import write

log = logging.getLogger(__name__)

MODES = ("sync", "async", "zero_stall")
"""How a save runs: see the module's table."""


@dataclass(frozen=True)
class Taken:
    """What a save took in the call: the ``state`` to plan; for a zero-stall save, the
    ``check`` that a tensor (by its key in the state) is unchanged since the call (None when
    the capture failed, ``failed`` then saying why: raised in the planning step, on every
    rank) and the CUDA event its copy waits for."""

    state: dict[str, Any]
    check: Callable[[str], None] | None = None
    failed: Exception | None = None
    marker: Any = None


def run(save: Save, state: dict[str, Any], mode: str) -> SaveFuture:
    """Run ``save`` of ``state`` in ``mode``; its future (done already for ``sync``).

    Zero-stall: capture in the call, then every phase in the background, in turn. Sync and
    async: the phases in the call, after every earlier save; an async save that copies hands
    its write and commit to the background and returns once the copy is done."""
    report = None
    try:
        if mode == "zero_stall":
            taken = _take(save, state)
            save.turn.proceed(lambda: phases(save, taken, mode), background=True)
        else:
            save.turn.wait()
            report = phases(save, Taken(state), mode)
    except BaseException as e:  # failed in the call: nothing runs on
        save.turn.end(error=e)
        raise
    if report is not None:
        save.turn.end(report)
    if mode == "async":
        save.future.wait_snapshot()
    save.future.blocking_s = time.perf_counter() - save.future.started_s
    return save.future


def _take(save: Save, state: dict[str, Any]) -> Taken:
    """A zero-stall save's capture (what fails in it is raised in the planning step, on
    every rank); from now on every optimizer step of the process waits for the copy."""
    try:
        captured = capture(state)
        taken = Taken(captured.state, captured.check)
    except Exception as e:  # noqa: BLE001 - raised in the planning step, on every rank
        taken = Taken({}, failed=e)
    marker = stream_marker()  # CUDA: the copy starts after the caller's queued kernels
    hold_steps(save.future)
    return replace(taken, marker=marker)


def phases(save: Save, taken: Taken, mode: str) -> SaveReport | None:
    """Plan, copy, write and commit, in turn; the report. A sync save, and an async one over
    the budget, write from the live tensors; an async save that copies hands its write and
    commit to the background once it has started the copy (None)."""
    planned = plan(save, taken.state, taken.failed)
    in_call = mode == "sync" or (mode == "async" and not stages(save, planned))
    if in_call and mode != "sync":
        log.info("%d bytes exceed the staging budget; saving in the call", planned.nbytes)
    try:
        if in_call:
            copied = Copy(live(planned))
        else:  # an async save's caller waits for the copy: torch's threads help
            copied = copy(save, planned, taken.check, mode == "async", taken.marker)
    except BaseException:  # interrupted: nothing stays held
        if planned.release is not None:
            planned.release()
        raise
    background = mode == "async" and not in_call  # the call returns once the copy is done
    return save.turn.proceed(lambda: write_and_commit(save, planned, copied), background)


def write_and_commit(save: Save, planned: PlannedSave, copied: Copy) -> SaveReport:
    """Phases 4 and 5, on every rank together; raise everywhere when any rank failed."""
    written = write(save, planned, copied)
    return commit(save, planned, written)


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
