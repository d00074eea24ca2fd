"""ByteCheckpoint 0.0.2 (``bytecheckpoint``), framework ``fsdp2``. Runs in the peers environment."""

from __future__ import annotations

from pathlib import Path

import bytecheckpoint as bcp

from unickpt.bench.model import TrainState
from unickpt.bench.systems.base import CheckpointSystem, SaveHandle


class ByteCheckpointSystem(CheckpointSystem):
    """``bcp.save`` / ``bcp.load`` of ``{"model", "optimizer"}``; synchronous save (its
    ``fast_saving`` gains nothing without a GPU to copy from), parallel ``fast_loading``."""

    notes = "framework fsdp2, fast_saving=False, fast_loading=True; files fsynced"

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        bcp.save(str(path), state.state(), framework="fsdp2", fast_saving=False)
        return SaveHandle()

    def load(self, path: Path, state: TrainState) -> None:
        bcp.load(str(path), state.state(), framework="fsdp2", fast_loading=True)
