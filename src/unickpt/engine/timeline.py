"""Where a save's time goes on one rank: seconds per phase, for :class:`SaveReport`.

Wall-clock phases (``plan``, ``file``, ``complete``, ``gather``, ``commit``) follow one another
on the saving thread; thread phases (``hash``, ``write``, ``compress``) are summed over the
writer threads, which run them side by side, so they may exceed the wall time of ``file``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("plan", "compress", "hash", "write", "file", "complete", "gather", "commit")
"""The phases, in the order a save passes them."""


class Timeline:
    """Seconds spent per phase; safe to add to from many threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self._seconds[phase] = self._seconds.get(phase, 0.0) + seconds

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t0)

    def seconds(self) -> dict[str, float]:
        """The phases measured, in :data:`PHASES` order."""
        with self._lock:
            return {p: self._seconds[p] for p in PHASES if p in self._seconds}


@contextmanager
def timed(timeline: Timeline | None, phase: str) -> Iterator[None]:
    """:meth:`Timeline.timed`, or nothing without a timeline."""
    if timeline is None:
        yield
        return
    with timeline.timed(phase):
        yield
