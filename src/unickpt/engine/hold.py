"""Every optimizer step of the process waits while a zero-stall snapshot is being copied.

One global step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``) serves
every save and every optimizer, wherever it sits: in the state, inside a trainer object, or
nowhere near the checkpoint. It is registered by the first zero-stall save and stays for the
life of the process (``step()`` iterates the hooks while it calls them, and steps may run on
other threads, so removing it later could break a step); with no snapshot in flight it returns
after one list check.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .futures import SaveFuture

_HELD: list[SaveFuture] = []
_LOCK = threading.Lock()
_REGISTERED = False


def hold_steps(fut: SaveFuture) -> None:
    """Make every optimizer step of this process wait until ``fut``'s snapshot is done."""
    global _REGISTERED
    with _LOCK:
        if not _REGISTERED:
            register_optimizer_step_pre_hook(_wait_for_snapshots)
            _REGISTERED = True
        _HELD[:] = [f for f in _HELD if not f.snapshot_done()]
        _HELD.append(fut)


def held() -> list[SaveFuture]:
    """The saves whose snapshot the next step waits for (finished ones are dropped lazily)."""
    with _LOCK:
        return [f for f in _HELD if not f.snapshot_done()]


def _wait_for_snapshots(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _HELD:
        return
    with _LOCK:
        pending = list(_HELD)
    for fut in pending:
        if not fut.snapshot_done():
            t0 = time.perf_counter()
            fut.wait_snapshot()
            fut.blocking_s += time.perf_counter() - t0
    with _LOCK:
        _HELD[:] = [f for f in _HELD if not f.snapshot_done()]
