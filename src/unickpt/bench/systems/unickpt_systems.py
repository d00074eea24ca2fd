"""unickpt itself: synchronous save, async save, and zero-stall."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import unickpt
from unickpt.bench.model import TrainState
from unickpt.bench.systems.base import CheckpointSystem, SaveHandle
from unickpt.bench.systems.registry import SystemInfo


class _UnickptFuture(SaveHandle):
    def __init__(self, future: Any, wait_snapshot: bool) -> None:
        self._future = future
        self._wait_snapshot = wait_snapshot
        self.step_waits = not wait_snapshot

    def wait_until_mutable(self) -> None:
        if self._wait_snapshot:
            self._future.wait_snapshot()

    def wait(self) -> None:
        self._future.wait()


def _settings() -> str:
    from unickpt.config import get_config

    cfg = get_config()
    verify = "checksums written and verified" if cfg.verify else "verification off"
    return f"io_threads={cfg.io_threads}, plan cached after the first save, {verify}"


class UnickptSystem(CheckpointSystem):
    """``unickpt.save`` / ``unickpt.load`` of ``{"model": model, "optimizer": optimizer}``."""

    _HOW = "durable when save returns"

    def __init__(self, info: SystemInfo) -> None:
        super().__init__(info)
        self.notes = f"{self._HOW}; {_settings()}"

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        unickpt.save(str(path), state.state())
        return SaveHandle()

    def load(self, path: Path, state: TrainState) -> None:
        self.bytes_read_reported = unickpt.load(str(path), state.state()).bytes_read


class UnickptAsyncSystem(UnickptSystem):
    """``unickpt.async_save``; training waits for ``wait_snapshot()`` before the next step."""

    _HOW = "blocking = call + wait_snapshot(); staging arena reused between saves"

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        return _UnickptFuture(unickpt.async_save(str(path), state.state()), True)


class UnickptZeroStallSystem(UnickptSystem):
    """``async_save(zero_stall=True)``: the call returns at once; the copy overlaps
    forward and backward, and the next ``optimizer.step()`` waits for it."""

    _HOW = (
        "blocking = call + wait inside the next optimizer.step; stall includes the background "
        "copy and writes competing with the iteration"
    )

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        future = unickpt.async_save(str(path), state.state(), zero_stall=True)
        return _UnickptFuture(future, False)
