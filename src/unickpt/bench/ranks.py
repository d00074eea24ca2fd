"""Start a benchmark's rank processes: new processes forked from a fork server.

The server imports torch and unickpt once; each rank is forked from it, so it starts with them
imported instead of importing them again as a fresh ("spawn") interpreter does (a few CPU
seconds per process). A rank is still a new process: the server ran nothing but the imports, so
a rank holds no state, buffers or threads of the benchmark that starts it. It runs in the
environment and on the CPUs the starting process has when it starts it (a process forked from
the server would otherwise have the server's), and it leaves as an exiting interpreter does:
its threads finished, then its exit hooks.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

# What the fork server imports once, for every rank forked from it: the benchmarks' ranks use
# the API, the Checkpointer and its tiers, and the S3 backend.
PRELOAD = ("torch", "torch.distributed", "unickpt", "unickpt.api", "unickpt.storage.s3")


Context = multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext


def context() -> Context:
    """The ranks' start method: forked from a server that imported :data:`PRELOAD` (a fresh
    interpreter each where the platform has no fork server)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def start(
    ctx: Context,
    target: Callable[..., None],
    *args: Any,
    cpus: Iterable[int] | None = None,
) -> multiprocessing.process.BaseProcess:
    """Start ``target(*args)`` in a new process of ``ctx`` (from :func:`context`), in this
    process's environment, on ``cpus`` (default: this process's CPUs); the process, started.
    A process pinned to fewer CPUs than this one has uses as many compute threads as its CPUs,
    as an interpreter started on them would."""
    mine = set(os.sched_getaffinity(0))
    chosen = mine if cpus is None else set(cpus)
    proc = ctx.Process(target=_entry, args=(dict(os.environ), chosen, chosen != mine, target, args))
    proc.start()
    return proc


def _entry(
    environ: dict[str, str],
    cpus: set[int],
    pinned: bool,
    target: Callable[..., None],
    args: tuple[Any, ...],
) -> None:
    take_environment(environ)
    os.sched_setaffinity(0, cpus)
    if pinned:
        import torch

        torch.set_num_threads(len(cpus))
    try:
        target(*args)
    finally:
        exit_hooks()


def free_port() -> int:
    """A loopback port free now, for the ranks' rendezvous (or a server of the benchmark)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def take_environment(environ: dict[str, str]) -> None:
    """Make this process's environment ``environ`` (its starter's when it started it): a
    process forked from the fork server inherits the server's, from when the server started."""
    os.environ.clear()
    os.environ.update(environ)


def exit_hooks() -> None:
    """Finish this process's threads, then run its exit hooks, as an exiting interpreter does
    (unickpt's pending saves, the release of its process groups): a process forked from the
    fork server leaves by ``os._exit``, which runs neither."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
