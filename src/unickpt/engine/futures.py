"""The handle of an asynchronous save, and the report of a finished one."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..format.metadata import EncodingError


@dataclass(frozen=True)
class SaveReport:
    """Figures of one finished save on this rank."""

    bytes_written: int
    write_s: float
    commit_s: float
    plan_cached: bool
    encoding_errors: dict[str, EncodingError] = field(default_factory=dict)
    """For each quantized table, what quantization changed in its values."""
    timeline: dict[str, float] = field(default_factory=dict)
    """Seconds per phase on this rank (:data:`unickpt.engine.timeline.PHASES`): ``plan``;
    summed over the writer threads ``compress``, ``hash`` and ``write`` (into the storage);
    ``file`` (the data file's parts, wall), ``complete`` (its fsync and rename, with the
    index written meanwhile), ``gather`` (waiting for every rank) and ``commit`` (metadata and
    marker, on the coordinator)."""


class SaveFuture:
    """Tracks one asynchronous save.

    ``wait_snapshot()`` returns once the state has been copied (tensors may change after it);
    ``wait()`` returns once the checkpoint is committed and re-raises, with its traceback, any
    failure of the background work.

    >>> fut = unickpt.async_save("ckpt/step-10", state)  # doctest: +SKIP
    >>> fut.wait()  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._snapshot = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: Any = None
        self.started_s = time.perf_counter()
        self.blocking_s = 0.0
        self.snapshot_s: float | None = None
        self.durable_s: float | None = None
        self.path: str | None = None
        self.error_reported = False

    def done(self) -> bool:
        """Whether the save ended (committed or failed)."""
        return self._done.is_set()

    def snapshot_done(self) -> bool:
        """Whether the state has been copied (tensors may change from then on)."""
        return self._snapshot.is_set()

    def wait_snapshot(self, timeout_s: float | None = None) -> None:
        """Wait until the state has been copied; TimeoutError after ``timeout_s``."""
        if not self._snapshot.wait(timeout_s):
            raise TimeoutError(f"the snapshot did not finish within {timeout_s} s")

    def wait(self, timeout_s: float | None = None) -> Any:
        """Wait until the checkpoint is committed and return the save's report (a
        ``SaveReport``); re-raise the background work's failure; TimeoutError after
        ``timeout_s``."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"the save did not finish within {timeout_s} s")
        if self._error is not None:
            self.error_reported = True
            raise self._error
        return self._result

    def wait_done(self) -> None:
        """Wait until the save ends, committed or failed, without raising its error."""
        self._done.wait()

    def exception(self) -> BaseException | None:
        """The failure of an ended save, or None."""
        return self._error if self._done.is_set() else None

    def set_snapshot_done(self) -> None:
        """Mark the snapshot done (called by the save)."""
        if not self._snapshot.is_set():
            self.snapshot_s = time.perf_counter() - self.started_s
            self._snapshot.set()

    def set_result(self, result: Any) -> None:
        """End the save with ``result`` (called by the save)."""
        self._result = result
        self.durable_s = time.perf_counter() - self.started_s
        self.set_snapshot_done()
        self._done.set()

    def set_exception(self, error: BaseException) -> None:
        """End the save with ``error`` (called by the save)."""
        self._error = error
        self.set_snapshot_done()
        self._done.set()

    @staticmethod
    def completed(result: Any) -> SaveFuture:
        """A future of a save that already ended with ``result`` (a synchronous save's)."""
        fut = SaveFuture()
        fut.set_result(result)
        return fut
