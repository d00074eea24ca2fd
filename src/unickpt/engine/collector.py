"""Python's cyclic garbage collector, paused while a load runs.

A load makes thousands of small objects (its plan: read items, needs, units, parts, views)
that reference counting frees as soon as the load is done with them. Every 700 allocations
start a collection, and every so often one of the whole heap: in a process holding a model,
its optimizer and torch (hundreds of thousands of objects), one full collection took 100-200
ms on the development machine, more than a load of 400 MB from the page cache. The collector
is paused for the load and restored after it as it was (still off if the caller had turned it
off); what the load leaves behind, and other threads' cycles, are collected at the next
collection after it, as they would have been.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_paused = 0  # loads running now, in any thread
_was_enabled = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the collector until the last load running in the process ends."""
    global _paused, _was_enabled
    with _lock:
        if _paused == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _lock:
            _paused -= 1
            if _paused == 0 and _was_enabled:
                gc.enable()
