"""Megatron-Core 0.16.1 ``dist_checkpointing`` (torch_dist backend). Runs in the peers environment.

Each FSDP2 shard becomes a ``ShardedTensor`` on a regular grid (``from_rank_offsets``), the
optimizer's moments alike; the replicated ``step`` is saved by rank 0 only (``replica_id``).
Saving calls ``torch.cuda.synchronize()`` and ``torch.cuda.current_device()``; without CUDA
those two are replaced for the run by a no-op and ``"cpu"``. Best settings: one
``TorchDistSaveShardedStrategy`` kept for every save, with as many writer threads as unickpt
and its cached global metadata on (later saves skip gathering the local metadata). Its
fully-parallel wrapper only spreads replicated shards, and FSDP2 replicates none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from unickpt.bench.model import TrainState, local_part
from unickpt.bench.systems.base import CheckpointSystem, SaveHandle
from unickpt.bench.systems.registry import SystemInfo
from unickpt.bench.systems.torch_systems import writer_threads


def _shim_cuda() -> None:
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


def _sharded(key: str, tensor: torch.Tensor, like: torch.Tensor) -> ShardedTensor:
    """A ShardedTensor for ``tensor``, split like the DTensor ``like`` (Shard(d) over ranks)."""
    placements = getattr(like, "placements", None)
    local = local_part(tensor)
    if placements is None or local.dim() == 0:
        replica = 0 if dist.get_rank() == 0 else 1
        return ShardedTensor.from_rank_offsets(key, local.view(1), replica_id=replica)
    dim = placements[0].dim
    return ShardedTensor.from_rank_offsets(
        key, local, (dim, dist.get_rank(), dist.get_world_size())
    )


def sharded_state_dict(state: TrainState) -> dict[str, ShardedTensor]:
    out: dict[str, ShardedTensor] = {}
    for name, param in state.model.named_parameters():
        out[f"model.{name}"] = _sharded(f"model.{name}", param, param)
        for key, value in state.optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                full_key = f"optimizer.{name}.{key}"
                out[full_key] = _sharded(full_key, value, param)
    return out


class MegatronSystem(CheckpointSystem):
    def __init__(self, info: SystemInfo) -> None:
        super().__init__(info)
        _shim_cuda()
        threads = writer_threads()
        self._strategy = TorchDistSaveShardedStrategy(
            "torch_dist", 1, thread_count=threads, cached_metadata=True
        )
        self.notes = (
            f"dist_checkpointing torch_dist, synchronous; TorchDistSaveShardedStrategy("
            f"thread_count={threads}, cached_metadata=True) kept between saves; no replicas to "
            "spread (FullyParallel wrapper not needed); CUDA calls shimmed on CPU"
        )

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(
            sharded_state_dict(state), str(path), sharded_strategy=self._strategy
        )
        return SaveHandle()

    def load(self, path: Path, state: TrainState) -> None:
        targets = sharded_state_dict(state)
        loaded: dict[str, Any] = dist_checkpointing.load(targets, str(path))
        with torch.no_grad():
            for key, target in targets.items():
                value = loaded[key]
                if value.data_ptr() != target.data.data_ptr():
                    target.data.copy_(value)
