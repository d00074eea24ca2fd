"""PyTorch's own ways to checkpoint: DCP (sync, async thread, async process) and torch.save."""

from __future__ import annotations

import inspect
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
from unickpt.storage.local import fsync_dir


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


def _async_handle(result: Any) -> SaveHandle:
    """The handle of ``dcp.async_save``'s result: a future, or a response whose staging
    completion says when the state may change (asynchronous staging)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    if isinstance(result, AsyncSaveResponse):
        return _FutureHandle(result.upload_completion, result.staging_completion)
    return _FutureHandle(result)


def writer_threads() -> int:
    """unickpt's writer threads (``io_threads``), which DCP and the peers get too."""
    from unickpt.config import get_config

    return get_config().io_threads


def _has_plan_caching() -> bool:
    from torch.distributed.checkpoint import DefaultSavePlanner

    return "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters


class DcpSystem(CheckpointSystem):
    """``dcp.save`` / ``dcp.load`` through ``get_state_dict`` / ``set_state_dict``, with as many
    writer threads as unickpt and, where this torch has it, the save plan cached."""

    def __init__(self, info: SystemInfo) -> None:
        super().__init__(info)
        self._threads = writer_threads()
        self._plan_caching = _has_plan_caching()
        caching = (
            "DefaultSavePlanner(enable_plan_caching=True)"
            if self._plan_caching
            else "no plan caching in this torch"
        )
        self.notes = (
            f"FileSystemWriter(thread_count={self._threads}, sync_files=True), as many writer "
            f"threads as unickpt; {caching}; load and reshard via get/set_state_dict "
            "(FileSystemReader has no thread setting)"
        )

    def _writer(self, path: Path) -> dcp.FileSystemWriter:
        return dcp.FileSystemWriter(str(path), thread_count=self._threads, sync_files=True)

    def _planner(self) -> dcp.DefaultSavePlanner:
        if self._plan_caching:
            return dcp.DefaultSavePlanner(enable_plan_caching=True)  # type: ignore[call-arg]
        return dcp.DefaultSavePlanner()

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        dcp.save(
            sharded_state_dict(state), storage_writer=self._writer(path), planner=self._planner()
        )
        return SaveHandle()

    def load(self, path: Path, state: TrainState) -> None:
        target = sharded_state_dict(state)
        dcp.load(target, checkpoint_id=str(path))
        apply_state_dict(state, target, None)


def _stager(state_on_cuda: bool, shared_memory: bool) -> Any:
    """DCP's ``DefaultStager``, kept for every save so its staging buffers are reused: on CUDA
    pinned memory, staging in its own thread and non-blocking copies; on CPU plain copies
    (PyTorch refuses pinning and asynchronous staging without a device)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=state_on_cuda,
        use_shared_memory=shared_memory,
        use_async_staging=state_on_cuda,
        use_non_blocking_copy=state_on_cuda,
    )
    return DefaultStager(options)


def stager_reusable(torch_version: str) -> bool:
    """Whether a ``DefaultStager`` survives a second ``async_save``: PyTorch 2.11 closes it at
    the end of every staging, and the next save fails with ``KeyError: <class 'type'>``
    (pytorch/pytorch#183413, fixed after 2.11).

    >>> stager_reusable("2.11.0+cu130"), stager_reusable("2.13.0+cpu")
    (False, True)
    """
    return not torch_version.startswith("2.11.")


class DcpAsyncThreadSystem(DcpSystem):
    """``dcp.async_save`` with the thread executor and one ``DefaultStager`` reused by every
    save (its copies of the state are kept between saves instead of allocated each time), or,
    on a PyTorch whose stager cannot be reused (:func:`stager_reusable`), a new one per save.

    As PyTorch documents, the background save gets its own gloo group: its collectives would
    otherwise interleave with the training's on the default group."""

    _SHARED_MEMORY = False

    def __init__(self, info: SystemInfo) -> None:
        super().__init__(info)
        self._group = dist.new_group(backend="gloo")
        self._stager: Any = None

    def _stager_notes(self, cuda: bool) -> str:
        pinned = "pinned, asynchronous staging, non-blocking copies" if cuda else "CPU memory"
        return f"thread executor (own gloo group); {_stager_use()} ({pinned})"

    def _async_save(self, path: Path, state: TrainState, **kwargs: Any) -> SaveHandle:
        cuda = state.device != "cpu"
        if self._stager is None:
            self.notes = f"{self._stager_notes(cuda)}; {self.notes}"
        elif not stager_reusable(torch.__version__):
            self._stager.close()
            self._stager = None
        if self._stager is None:
            self._stager = _stager(cuda, self._SHARED_MEMORY)
        result = dcp.async_save(
            sharded_state_dict(state),
            storage_writer=self._writer(path),
            planner=self._planner(),
            process_group=self._group,
            async_stager=self._stager,
            **kwargs,
        )
        return _async_handle(result)

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        return self._async_save(path, state)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
        dist.destroy_process_group(self._group)


def _stager_use() -> str:
    if stager_reusable(torch.__version__):
        return "one DefaultStager reused by every save"
    return f"a new DefaultStager per save (torch {torch.__version__} cannot reuse one)"


class DcpAsyncProcessSystem(DcpAsyncThreadSystem):
    """``dcp.async_save`` with the process executor and a ``DefaultStager`` staging into
    shared memory (pinned too on CUDA), which the writing process reads without a copy."""

    _SHARED_MEMORY = True

    def _stager_notes(self, cuda: bool) -> str:
        pinned = "pinned + shared, asynchronous staging" if cuda else "shared memory"
        return f"process executor; {_stager_use()} ({pinned})"

    def save(self, path: Path, state: TrainState) -> SaveHandle:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        return self._async_save(path, state, async_checkpointer_type=AsyncCheckpointerType.PROCESS)


class TorchSaveSystem(CheckpointSystem):
    """The whole state gathered to rank 0 and written with ``torch.save`` into one file.

    Loading: rank 0 reads the file and the values are broadcast to every rank, which also makes
    the resharded load work (the file holds full tensors)."""

    notes = (
        "full state gathered to rank 0 (cpu_offload), one file, fsync; load broadcasts from "
        "rank 0; nothing to tune"
    )

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
    fsync_dir(file.parent)
