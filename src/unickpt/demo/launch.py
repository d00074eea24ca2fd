"""Starting the training processes of a phase, relaying their events, and killing one.

:func:`launch_phase` starts ``world_size`` processes that meet over gloo through a file in the
output folder, so no port is needed. Rank 0 sends its events through a queue; the launcher
hands them to the caller's sink. When the phase has ``kill_at``, the launcher sends SIGKILL to
the last rank as soon as rank 0 reports that the save of that step started (the write is then
in flight), and stops the other ranks, as ``torchrun`` does when a worker dies.

:func:`run_under_torchrun` is the entry point when ``torchrun`` started the processes itself.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import queue
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist

from unickpt.demo.config import DemoConfig, DemoError, Phase, processes_label
from unickpt.demo.events import Event, EventSink, SaveStarted, WorkerKilled, discard
from unickpt.demo.train import run_phase

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_STOP_GRACE_S = 10.0


def launch_phase(config: DemoConfig, phase: Phase, sink: EventSink) -> None:
    """Runs ``phase`` in fresh processes and returns when they are gone."""
    context = _context()
    events: Any = context.Queue()
    # Absolute: a file:// URL of a relative path (the default out/demo) names a host instead.
    store = os.path.abspath(os.path.join(config.out_dir, f".rendezvous-{phase.name}"))
    if os.path.exists(store):
        os.remove(store)
    processes = [
        context.Process(
            target=_worker, args=(config, phase, rank, store, events), name=f"{phase.name}-{rank}"
        )
        for rank in range(phase.world_size)
    ]
    for process in processes:
        process.start()
    try:
        killed = _relay(phase, processes, events, sink)
        _check_exits(phase, processes, killed)
    finally:
        _stop(processes, signal.SIGKILL)
        events.close()
        if os.path.exists(store):
            os.remove(store)


def _context() -> Any:
    """A fork server where there is one: it imports torch once, then forks each worker fast."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def run_under_torchrun(config: DemoConfig, sink: EventSink) -> int:
    """Trains (resuming from ``config.out_dir`` if it holds checkpoints) in this process.

    Reads ``RANK`` and ``WORLD_SIZE`` as set by ``torchrun``; only rank 0 uses ``sink``.
    Returns this process's rank.
    """
    world_size = int(os.environ["WORLD_SIZE"])
    if config.micro_batches % world_size:
        raise DemoError(
            f"torchrun started {world_size} processes, but the global batch is split into "
            f"{config.micro_batches} micro-batches; use --nproc-per-node 1 or 2"
        )
    phase = Phase(
        "torchrun",
        f"train, {processes_label(world_size)}",
        world_size,
        config.steps,
        checkpoint=True,
        resume=True,
    )
    with _process_group(world_size, int(os.environ["RANK"]), "env://"):
        rank = dist.get_rank() if world_size > 1 else 0
        run_phase(config, phase, sink if rank == 0 else discard)
    return rank


def _worker(config: DemoConfig, phase: Phase, rank: int, store: str, events: Any) -> None:
    faulthandler.enable()  # a worker killed by a fatal signal prints where it was first
    with _process_group(phase.world_size, rank, f"file://{store}"):
        run_phase(config, phase, events.put if rank == 0 else discard)
    events.close()
    events.join_thread()


@contextmanager
def _process_group(world_size: int, rank: int, init_method: str) -> Iterator[None]:
    if world_size == 1:
        yield
        return
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _relay(
    phase: Phase, processes: Sequence[BaseProcess], events: Any, sink: EventSink
) -> int | None:
    """Hands events to ``sink`` until every process has exited; returns the killed rank."""
    killed: int | None = None
    while True:
        try:
            event: Event = events.get(timeout=_POLL_S)
        except queue.Empty:
            if killed is None and any(p.exitcode not in (None, 0) for p in processes):
                return None
            if not any(p.is_alive() for p in processes):
                return killed
            continue
        sink(event)
        if killed is None and isinstance(event, SaveStarted) and event.step == phase.kill_at:
            killed = _kill_one(phase, processes, sink)


def _kill_one(phase: Phase, processes: Sequence[BaseProcess], sink: EventSink) -> int:
    rank = len(processes) - 1
    victim = processes[rank]
    assert victim.pid is not None and phase.kill_at is not None
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    logger.info("sent SIGKILL to rank %d (pid %d) at step %d", rank, victim.pid, phase.kill_at)
    sink(WorkerKilled(phase.name, rank, victim.pid, phase.kill_at))
    _stop(processes, signal.SIGTERM)
    return rank


def _stop(processes: Sequence[BaseProcess], sig: signal.Signals) -> None:
    for process in processes:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, sig)
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGKILL)
            process.join()


def _check_exits(phase: Phase, processes: Sequence[BaseProcess], killed: int | None) -> None:
    if phase.kill_at is not None and killed is None:
        raise DemoError(
            f"phase {phase.name!r} ended before the save of step {phase.kill_at}, so no worker "
            "was killed; see the errors above"
        )
    if killed is not None:
        return
    failed = [(rank, p.exitcode) for rank, p in enumerate(processes) if p.exitcode not in (None, 0)]
    if failed:
        rank, code = failed[0]
        raise DemoError(
            f"rank {rank} of phase {phase.name!r} exited with code {code}; its error is printed "
            "above"
        )
