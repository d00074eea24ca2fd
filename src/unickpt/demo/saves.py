"""Asynchronous saves with their costs measured: the training stall and the time to durable."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import unickpt
from unickpt.demo.events import EventSink, SaveDurable, SaveStarted

logger = logging.getLogger(__name__)


class SaveTracker:
    """Starts saves on a :class:`unickpt.Checkpointer` and reports when each becomes durable.

    A background thread waits on each save's future, so training never blocks on the write.
    The events are emitted from the training thread, in :meth:`poll` and :meth:`close`; an error
    of a save is raised there too.
    """

    def __init__(self, checkpointer: unickpt.Checkpointer, phase: str, sink: EventSink) -> None:
        self._checkpointer = checkpointer
        self._phase = phase
        self._sink = sink
        self._lock = threading.Lock()
        self._finished: list[SaveDurable | BaseException] = []
        self._threads: list[threading.Thread] = []

    def save(self, step: int, state: dict[str, Any]) -> None:
        start = time.perf_counter()
        future = self._checkpointer.save(step, state)
        blocking_s = time.perf_counter() - start  # what the training loop waited
        self._sink(SaveStarted(self._phase, step, blocking_s))
        thread = threading.Thread(
            target=self._await_durable, args=(step, future, start), daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def poll(self) -> None:
        """Emits the saves that became durable since the last call."""
        with self._lock:
            finished, self._finished = self._finished, []
        for item in finished:
            if isinstance(item, BaseException):
                raise item
            self._sink(item)

    def close(self) -> None:
        """Waits for every pending save, then emits what is left."""
        self._checkpointer.close()
        for thread in self._threads:
            thread.join()
        self.poll()

    def _await_durable(self, step: int, future: unickpt.SaveFuture, start: float) -> None:
        try:
            future.wait()
            durable_s = time.perf_counter() - start  # from the call to save()
            size = directory_size(self._checkpointer.path(step))
            result: SaveDurable | BaseException = SaveDurable(self._phase, step, durable_s, size)
        except BaseException as error:  # noqa: BLE001 - re-raised in the training thread by poll()
            result = error
        with self._lock:
            self._finished.append(result)


def directory_size(path: str) -> int:
    """The bytes of all files under ``path`` (or of ``path`` itself when it is a file)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except FileNotFoundError:
                logger.debug("%s vanished while measuring %s", name, path)
    return total
