"""Run a function on N real processes joined by torch.distributed over gloo.

The ranks are forked from a server process that imported torch and unickpt once (the
"forkserver" start method) rather than started as fresh interpreters that import them again
("spawn"): importing torch costs a few CPU seconds per process, which on a 2-core machine was
much of the time of the multi-process tests. A rank still starts clean (the server imported
modules and ran nothing else), sees the environment the test has when it starts the ranks, and
leaves as an exiting interpreter does: its threads finished, then its exit hooks.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.process
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unickpt.bench.ranks import exit_hooks, take_environment

# What the fork server imports once, for every rank forked from it. ``unickpt`` imports its
# submodules when first used: ``unickpt.api`` (save, load and what they import, among them
# torch.distributed.checkpoint, DTensor and FSDP) costs about a CPU second a rank otherwise;
# ``torch._dynamo`` (with inductor, triton and onnx, about 280 modules) is imported by a rank's
# first DTensor operation, at one to two CPU seconds. Neither starts a thread.
PRELOAD = ["torch", "torch.distributed", "unickpt", "unickpt.api", "torch._dynamo"]


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too, for the ranks of a test run that import them
    (called before the server starts, as it does at the first ranks; later calls change nothing
    for a server already running). A module that cannot be imported is left out."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def context() -> multiprocessing.context.BaseContext:
    """The start method of the ranks: forked from a server that has imported ``PRELOAD``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _packed(result: tuple[int, bool, Any]) -> bytes:
    """A rank's result as plain pickle bytes: tensors travel by value. Through the queue's own
    pickler they would travel as shared memory whose file descriptor the receiver fetches from
    the sending process, which may have exited by then (FileNotFoundError in the test)."""
    return pickle.dumps(result)


def start_process(
    target: Callable[..., None], *args: Any, daemon: bool = False
) -> multiprocessing.process.BaseProcess:
    """Start ``target(*args)`` in a process forked from the fork server, in this process's
    environment; the process, started."""
    proc = context().Process(
        target=_in_environment, args=(dict(os.environ), target, args), daemon=daemon
    )
    proc.start()
    return proc


def _in_environment(environ: dict[str, str], target: Callable[..., None], args: Any) -> None:
    take_environment(environ)
    try:
        target(*args)
    finally:
        exit_hooks()


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    q: Any,
    stay: bool,
    environ: dict[str, str],
) -> None:
    take_environment(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    # One compute thread per rank (a test that wants more sets its own). The tests compare
    # training runs bit for bit, and with two threads a loaded machine made two uninterrupted
    # runs of the same job differ in their last bits (with one, none did); beyond a rank's
    # share of the cores, threads also only wait for busy ones. accelerate reads
    # OMP_NUM_THREADS: unset, it would set the threads from the physical cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        q.put(_packed((rank, True, result)))
    except BaseException as e:  # noqa: BLE001 - sent to the test
        q.put(_packed((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
    finally:
        if stay:
            time.sleep(3600)  # until the test kills it
        if dist.is_initialized():
            dist.destroy_process_group()
        exit_hooks()


def _start(
    world: int, fn: Callable[..., Any], args: tuple[Any, ...], stay: bool
) -> tuple[list[Any], Any]:
    ctx = context()
    q = ctx.Queue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, q, stay, environ), daemon=stay)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs, q


def run_ranks(
    world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 180.0
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return their results.

    ``fn`` must be importable (a module-level function). A failure on any rank fails the
    caller with that rank's traceback.
    """
    procs, q = _start(world, fn, args, stay=False)
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, ok, value = pickle.loads(q.get(timeout=timeout_s))
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def start_ranks(
    world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 180.0
) -> tuple[list[Any], list[Any]]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes that stay alive after it
    returns; the processes (for the caller to kill) and the results."""
    procs, q = _start(world, fn, args, stay=True)
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, value = pickle.loads(q.get(timeout=timeout_s))
            if not ok:
                raise AssertionError(f"rank {rank}: {value}")
            results[rank] = value
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs, [results[r] for r in range(world)]


def shared_dir(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    return str(path)
