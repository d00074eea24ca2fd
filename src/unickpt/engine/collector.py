"""Python's cyclic garbage collector, paused while a load runs.

A load makes thousands of small objects (its plan) that reference counting frees. Their
allocations start collections, now and then one of the whole heap: in a 100M-parameter FSDP2
job (about 325,000 objects) one took 0.2 s and stalled every thread of the load it fell in.
The collector is paused for the load and then restored as it was; what the load and other
threads leave behind is collected at the next collection after it.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_loads = 0  # loads running in the process
_was_enabled = False  # whether the collector ran before the first of them


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the collector until the last load running in the process ends."""
    global _loads, _was_enabled
    with _lock:
        if _loads == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _loads += 1
    try:
        yield
    finally:
        with _lock:
            _loads -= 1
            if _loads == 0 and _was_enabled:
                gc.enable()
