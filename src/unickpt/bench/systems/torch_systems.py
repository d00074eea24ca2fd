"""PyTorch's own ways to checkpoint: DCP (sync, async thread, async process) and torch.save."""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from unickpt.bench.model import TrainState
from unickpt.bench.systems.base import CheckpointSystem, SaveHandle
from unickpt.bench.systems.registry import SystemInfo


def sharded_state_dict(state: TrainState) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def apply_state_dict(
    state: TrainState, loaded: dict[str, Any], options: StateDictOptions | None
) -> None:
    # Model and optimizer separately: with broadcast_from_rank0 the other ranks pass empty
    # dicts, which set_state_dict would take as "optimizer only".
    set_model_state_dict(state.model, loaded["model"], options=options)
    set_optimizer_state_dict(state.model, state.optimizer, loaded["optimizer"], options=options)


class _FutureHandle(SaveHandle):
    def __init__(self, future: Any, staging: Future[None] | None = None) -> None:
        self._future = future
        self._staging = staging

    def wait_until_mutable(self) -> None:
        if self._staging is not None:
            self._staging.result()

    def wait(self) -> None:
        self._future.result()


class DcpSystem(CheckpointSystem):
    """``dcp.save`` / ``dcp.load`` through ``get_state_dict`` / ``set_state_dict``."""

    notes = "FileSystemWriter fsyncs each file; load and reshard via get/set_state_dict"

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        dcp.save(sharded_state_dict(state), checkpoint_id=str(path))
        return SaveHandle()

    def load(self, path: Path, state: TrainState) -> None:
        target = sharded_state_dict(state)
        dcp.load(target, checkpoint_id=str(path))
        apply_state_dict(state, target, None)


class DcpAsyncThreadSystem(DcpSystem):
    """``dcp.async_save`` with the default thread executor and default (blocking) stager.

    As PyTorch documents, the background save gets its own gloo group: its collectives would
    otherwise interleave with the training's on the default group."""

    notes = "stages to CPU memory in the call, then writes in a thread (own gloo group)"

    def __init__(self, info: SystemInfo) -> None:
        super().__init__(info)
        self._group = dist.new_group(backend="gloo")

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        future = dcp.async_save(
            sharded_state_dict(state), checkpoint_id=str(path), process_group=self._group
        )
        return _FutureHandle(future)

    def close(self) -> None:
        dist.destroy_process_group(self._group)


class DcpAsyncProcessSystem(DcpAsyncThreadSystem):
    """``dcp.async_save`` with the process executor and a ``DefaultStager`` asking for pinned
    and shared memory. Without CUDA, PyTorch ignores the pinning and stages to shared memory."""

    notes = "process executor; DefaultStager(pinned, shared); pinning is skipped without CUDA"

    def __init__(self, info: SystemInfo) -> None:
        super().__init__(info)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        options = StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=True,
            use_async_staging=False,
            use_non_blocking_copy=torch.cuda.is_available(),
        )
        self._stager = DefaultStager(options)

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
        )

        result = dcp.async_save(
            sharded_state_dict(state),
            checkpoint_id=str(path),
            process_group=self._group,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self._stager,
        )
        if isinstance(result, AsyncSaveResponse):
            return _FutureHandle(result.upload_completion, result.staging_completion)
        return _FutureHandle(result)

    def close(self) -> None:
        self._stager.close()
        super().close()


class TorchSaveSystem(CheckpointSystem):
    """The whole state gathered to rank 0 and written with ``torch.save`` into one file.

    Loading: rank 0 reads the file and the values are broadcast to every rank, which also makes
    the resharded load work (the file holds full tensors)."""

    notes = "full state gathered to rank 0, one file, fsync; load broadcasts from rank 0"

    _FILE = "state.pt"

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer, options=options)
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            _save_durably({"model": model_sd, "optimizer": optim_sd}, path / self._FILE)
        dist.barrier()
        return SaveHandle()

    def load(self, path: Path, state: TrainState) -> None:
        loaded: dict[str, Any] = {"model": {}, "optimizer": {}}
        if dist.get_rank() == 0:
            loaded = torch.load(path / self._FILE, map_location="cpu", weights_only=True)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        apply_state_dict(state, loaded, options)


def _save_durably(obj: object, file: Path) -> None:
    tmp = file.with_name(file.name + ".tmp")
    with tmp.open("wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.rename(file)
    dir_fd = os.open(file.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
