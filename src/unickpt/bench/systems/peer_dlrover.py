"""DLRover 0.6.1 flash checkpoint. Runs in the peers environment.

DLRover's FSDP checkpointer reads FSDP1 state dicts; with FSDP2 its engine is fed the
DTensor state dict that ``get_state_dict`` returns, which its DCP-based writer and reader
handle. The save copies into shared memory and returns; DLRover's saver process writes the
files. Durable = its tracker file names the step. Its shared-memory reader fails on FSDP2's
optimizer state, so loads read the files it wrote with its own file reader.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import dlrover.trainer.torch.flash_checkpoint.fsdp_engine as fsdp_engine
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dlrover.trainer.torch.flash_checkpoint.fsdp import FsdpShardCheckpointer

from unickpt.bench.model import TrainState
from unickpt.bench.systems.base import CheckpointSystem, SaveHandle
from unickpt.bench.systems.registry import SystemInfo
from unickpt.bench.systems.torch_systems import apply_state_dict, sharded_state_dict

_TRACKER = "dlrover_latest.txt"
_CheckpointConfig = fsdp_engine.CheckpointConfig


def _config_with_rank(*args: Any, **kwargs: Any) -> Any:
    config = _CheckpointConfig(*args, **kwargs)
    config.rank = dist.get_rank()
    return config


# Shim: DLRover's FSDP engine leaves CheckpointConfig.rank at 0 on every rank, so its saver
# writes one "done" file for all shards and never commits a multi-rank checkpoint.
fsdp_engine.CheckpointConfig = _config_with_rank  # type: ignore[misc,assignment]
_POLL_S = 0.005
_TIMEOUT_S = 1800.0


class _DlroverHandle(SaveHandle):
    """Durable once DLRover's saver has written ``step`` into its tracker file (after fsyncing
    every rank's file). Polled here every 5 ms: ``wait_latest_checkpoint`` polls every 3 s
    and raises until the tracker exists."""

    def __init__(self, tracker: Path, step: int) -> None:
        self._tracker = tracker
        self._step = str(step)

    def wait(self) -> None:
        deadline = time.monotonic() + _TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if self._tracker.read_text().strip() == self._step:
                    return
            time.sleep(_POLL_S)
        raise TimeoutError(f"DLRover did not commit step {self._step} in {_TIMEOUT_S:.0f} s")


class DlroverSystem(CheckpointSystem):
    notes = (
        "FSDP engine fed get_state_dict() (shim: rank in CheckpointConfig); copy to /dev/shm in "
        "the call, its saver process writes and fsyncs; load from shared memory fails on FSDP2 "
        "optimizer step tensors (KeyError), so loads read its files with its FileReader; a save "
        "issued while the previous persist holds its lock is skipped silently: retried here"
    )

    def __init__(self, info: SystemInfo) -> None:
        super().__init__(info)
        self._checkpointer: FsdpShardCheckpointer | None = None
        self._step = 0

    def _engine(self, path: Path) -> Any:
        if self._checkpointer is None:
            self._checkpointer = FsdpShardCheckpointer(str(path.parent))
        return self._checkpointer._engine

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        self._step += 1
        engine = self._engine(path)
        state_dict = sharded_state_dict(state)
        paths = {"model_states": str(path)}
        engine.save_to_storage(self._step, state_dict, paths)
        # DLRover skips a save without an error while its saver still holds the shared-memory
        # lock from the previous one; retry so the benchmark gets the checkpoint it asked for.
        while engine.latest_step != self._step:
            time.sleep(_POLL_S)
            engine.save_to_storage(self._step, state_dict, paths)
        return _DlroverHandle(path.parent / _TRACKER, self._step)

    def load(self, path: Path, state: TrainState) -> None:
        # DLRover's shared-memory reader raises KeyError on the optimizer's unsharded "step"
        # tensors of FSDP2, so the files its saver wrote are read with its file reader.
        target = sharded_state_dict(state)
        dcp.load(target, storage_reader=fsdp_engine.FileReader(str(path)))
        apply_state_dict(state, target, None)
