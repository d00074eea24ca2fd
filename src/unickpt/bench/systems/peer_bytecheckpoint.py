"""ByteCheckpoint 0.0.2 (``bytecheckpoint``), framework ``fsdp2``. Runs in the peers environment."""

from __future__ import annotations

import os
from pathlib import Path

import bytecheckpoint as bcp

from unickpt.bench.model import TrainState
from unickpt.bench.systems.base import CheckpointSystem, SaveHandle
from unickpt.bench.systems.registry import SystemInfo


class ByteCheckpointSystem(CheckpointSystem):
    """``bcp.save`` / ``bcp.load`` of ``{"model", "optimizer"}``; parallel ``fast_loading``.
    On CPU the save is synchronous (its ``fast_saving`` overlaps a device-to-host copy, which
    a CPU state does not have); on CUDA ``fast_saving`` and its pinned staging are on. Its
    writer threads come from ``BYTECHECKPOINT_STORE_WORKER_COUNT``, which the harness sets to
    unickpt's ``io_threads``."""

    def __init__(self, info: SystemInfo) -> None:
        super().__init__(info)
        workers = os.environ.get("BYTECHECKPOINT_STORE_WORKER_COUNT", "1")
        self._notes = (
            f"framework fsdp2, fast_loading=True, BYTECHECKPOINT_STORE_WORKER_COUNT={workers} "
            "(as many writer threads as unickpt); files fsynced"
        )
        self.notes = self._notes

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        fast = state.device != "cpu"
        self.notes = f"fast_saving={fast}, {self._notes}"
        bcp.save(str(path), state.state(), framework="fsdp2", fast_saving=fast)
        return SaveHandle()

    def load(self, path: Path, state: TrainState) -> None:
        bcp.load(str(path), state.state(), framework="fsdp2", fast_loading=True)
