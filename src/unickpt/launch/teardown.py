"""Leaving a membership that lost a process, in a process that stays.

1. unickpt forgets its groups and the caches of the membership (:func:`unickpt.dist.reset_groups`):
   a Checkpointer of the old membership raises when used, a pending save's next collective too;
2. torch's groups are aborted (NCCL's communicators are; torch forgets gloo's);
3. the group objects are dropped on a thread of their own (:class:`_Reaper`): a gloo group's
   destruction closes its connections, which ends the peers' collectives that wait on this
   process, but first waits for its own collective in flight, which ends once the peers'
   groups are gone in turn: no caller waits for it;
4. the background work of the old membership ends: pending saves (they fail once their groups
   are gone) and persists to storage (no collective: they finish). A new Checkpointer would
   take a persist's folder in storage for an interrupted save's debris.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..dist import reset_groups
from ..errors import RecoveryError

log = logging.getLogger(__name__)


class _Reaper:
    """A daemon thread that drops the objects it is given (one per process: made anew after a
    fork, which copies no thread)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.queue: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="unickpt-reaper", daemon=True).start()

    def _run(self) -> None:
        while True:
            doomed = self.queue.get()
            doomed.clear()  # the last references: a group's destruction runs here
            del doomed


_REAPER: _Reaper | None = None


def _reap(doomed: list[Any]) -> None:
    global _REAPER
    if _REAPER is None or _REAPER.pid != os.getpid():
        _REAPER = _Reaper()
    _REAPER.queue.put(list(doomed))
    doomed.clear()


def tear_down(timeout_s: float) -> float:
    """Leave the membership (above); seconds taken. Raises :class:`RecoveryError` when the
    old membership's saves or persists do not end within ``timeout_s``."""
    t0 = time.perf_counter()
    doomed = reset_groups()
    if dist.is_available() and dist.is_initialized():
        doomed.extend(c10d._world.pg_map)
        abort = getattr(c10d, "_abort_process_group", None)
        if abort is not None:
            abort()  # every group: NCCL's communicators aborted, torch's tables cleared
        else:
            dist.destroy_process_group()
    _reap(doomed)
    gc.collect()  # objects of the training function in reference cycles (DDP) hold groups
    _end_background(timeout_s)
    return time.perf_counter() - t0


def _end_background(timeout_s: float) -> None:
    from .. import api
    from ..tiers.policy import wait_persists

    ended = threading.Event()

    def work() -> None:
        api.wait_pending()  # raises nothing: the saves' failures are logged
        if wait_persists(timeout_s):
            ended.set()

    threading.Thread(target=work, name="unickpt-leave", daemon=True).start()
    if not ended.wait(timeout_s):
        raise RecoveryError(
            f"the saves or persists of the failed membership did not end within {timeout_s:.0f} "
            "s (a collective of another process that hangs, or storage); this process ends "
            "and the job restarts in full."
        )
