"""torchsnapshot 0.1.0. Runs in the peers environment.

torchsnapshot cannot take FSDP2's DTensors (".numpy() is not supported for tensor
subclasses"), so each rank's local shards are snapshotted as plain tensors: a per-rank
checkpoint that cannot be loaded into another layout. It does not fsync.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torchsnapshot

from unickpt.bench.model import TrainState, local_part
from unickpt.bench.systems.base import CheckpointSystem, SaveHandle, Unsupported


def _local_tensors(state: TrainState) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, param in state.model.named_parameters():
        out[f"model.{name}"] = local_part(param.data)
        for key, value in state.optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer.{name}.{key}"] = local_part(value)
    return out


class _Holder:
    """A stateful object over a dict of tensors that loads in place."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, Any]:
        return dict(self.tensors)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with torch.no_grad():
            for key, value in state_dict.items():
                if self.tensors[key].data_ptr() != value.data_ptr():
                    self.tensors[key].copy_(value)


class TorchSnapshotSystem(CheckpointSystem):
    notes = (
        "each rank's local shards as plain tensors (DTensor unsupported); no fsync; its "
        "scheduler's defaults (no writer-thread setting)"
    )

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        holder = _Holder(_local_tensors(state))
        torchsnapshot.Snapshot.take(str(path), {"state": holder}, replicated=[])  # type: ignore[dict-item]
        return SaveHandle()

    def load(self, path: Path, state: TrainState) -> None:
        holder = _Holder(_local_tensors(state))
        torchsnapshot.Snapshot(str(path)).restore({"state": holder})  # type: ignore[dict-item]

    def reshard_load(self, path: Path, state: TrainState) -> None:
        raise Unsupported("per-rank local shards; torchsnapshot cannot take FSDP2 DTensors")
