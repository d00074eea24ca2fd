"""Rank functions of the memory tier's tests with a failure on one rank, or a replica's rename
held back (importable by spawned processes).

A failure is injected by wrapping one function of the tier in the rank that fails: the wrapper
raises (or deletes a file, or waits for a gate file) before the real function runs, only at
the step named. Everything else is the real tier over real files and a real gloo group.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

import unickpt
from unickpt.config import get_config
from unickpt.errors import CheckpointError
from unickpt.tiers import group, memory, replicate

from .workers import ROWS, check, node_env, state, state_cols

TIMEOUT_S = 20.0  # a collective waiting for a rank that failed alone gives up after this


def _before(owner: Any, name: str, hook: Callable[..., None]) -> None:
    """Run ``hook(*args)`` ahead of every call of ``owner.name`` (it raises to inject)."""
    real = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        hook(*args, **kwargs)
        return real(*args, **kwargs)

    setattr(owner, name, wrapped)


def _renames(hook: Callable[[str, str], None]) -> None:
    """Run ``hook(src, dst)`` before each rename the replication makes (its own ``os``)."""
    real = os.replace

    def replace(src: Any, dst: Any) -> None:
        hook(str(src), str(dst))
        real(src, dst)

    replicate.os = types.SimpleNamespace(**{**vars(os), "replace": replace})  # type: ignore[assignment]


def _io_error(what: str) -> OSError:
    return OSError(errno.EIO, f"injected failure: {what}")


def _inject(rank: int, fault: str, at: int, ckpt: unickpt.Checkpointer) -> None:
    """Make this rank fail ``fault`` at step ``at`` (rank 0 is node a's only rank, and the
    coordinator; rank 1 is node b's)."""

    def is_step(path: Any) -> bool:
        return f"step-{at:09d}" in str(path)

    def read_committed(store: Any, step: int) -> None:
        if step != at:
            return
        if fault == "commit read":
            raise CheckpointError("injected failure: reading the commit")
        # "replica send": this rank's data file is gone before it is sent
        folder = store.step_path(step)
        for name in os.listdir(folder):
            if name.startswith("data-") and name.endswith("-00000.bin"):
                os.unlink(folder / name)

    def write_commit(store: Any, committed: Any) -> None:
        if committed.step == at:
            raise _io_error("writing the commit copy")

    def take_spare(store: Any, dest: Path, nbytes: int) -> None:
        if is_step(dest) and dest.name.endswith("-00000.bin"):  # rank 0's file, a replica
            raise _io_error("taking a spare file")

    def rename(src: str, dst: str) -> None:
        if is_step(dst):
            raise _io_error("renaming a replica's index")

    if fault in ("commit read", "replica send") and rank == 0:
        _before(replicate, "read_committed", read_committed)
    if fault == "commit copy" and rank == 1:
        _before(replicate, "write_commit", write_commit)
    if fault == "replica room" and rank == 1:
        _before(memory.MemoryStore, "take_spare", take_spare)
    if fault == "replica rename" and rank == 1:
        _renames(rename)


def saves_with_one_rank_failing(
    rank: int, world: int, root: str, dirs: dict[int, str], nodes: dict[int, str], faults: list[str]
) -> dict[str, Any]:
    """Save steps 1, 2, ...: at each even step one fault of ``faults`` in turn, each odd step
    clean. Every save's outcome on this rank, and the step and values ``load_latest`` finds."""
    node_env(rank, nodes)
    tier = unickpt.MemoryTier(persist_every=100, replicas=2, dir=dirs[rank])
    config = get_config(collective_timeout_s=TIMEOUT_S)
    ckpt = unickpt.Checkpointer(root, keep_last=3, memory=tier, config=config)
    rows = world * ROWS
    plan = {1: ""}
    for k, fault in enumerate(faults, 1):
        plan.update({2 * k: fault, 2 * k + 1: ""})
    outcomes = []
    for step, fault in plan.items():
        _inject(rank, fault, step, ckpt)
        spare = ckpt._tier.store.root / memory.SPARE if ckpt._tier and ckpt._tier.store else None
        if fault == "memory folder" and rank == 1 and spare is not None:
            shutil.rmtree(spare, ignore_errors=True)
            spare.write_text("not a folder")  # the job's folder changed from outside
        try:
            ckpt.save(step, state(step, rank, world, rows)).wait()
            outcomes.append("saved")
        except CheckpointError as e:
            outcomes.append(str(e))
        if fault == "memory folder" and rank == 1 and spare is not None:
            spare.unlink()
    dest = state(-1, rank, world, rows)
    newest = ckpt.load_latest(dest)
    assert newest is not None
    check(dest, newest, rank, world, rows)
    return {"outcomes": outcomes, "newest": newest}


def restores_with_one_rank_failing(
    rank: int,
    world: int,
    root: str,
    dirs: dict[int, str],
    nodes: dict[int, str],
    cols: bool,
    fault: str,
) -> tuple[Any, ...]:
    """Restore the newest step (node b lost) with ``fault`` injected on one rank: ``"room"``
    (rank 2 cannot make room for a file it receives), ``"index"`` (rank 2 cannot write the
    index of a file it received), ``"send"`` (rank 0 cannot open the file it sends). The step
    loaded and its source, or the error."""
    node_env(rank, nodes)

    def take_spare(store: Any, dest: Path, nbytes: int) -> None:
        raise _io_error("taking a spare file")

    def write_atomic(storage: Any, name: str, data: bytes) -> None:
        if name.startswith("index-"):
            raise _io_error(f"writing {name}")

    def opened(path: Path, nbytes: int, write: bool) -> None:
        if not write:
            raise _io_error(f"opening {path.name}")

    if fault == "room" and rank == 2:
        _before(memory.MemoryStore, "take_spare", take_spare)
    if fault == "index" and rank == 2:
        _before(memory.LocalStorage, "write_atomic", write_atomic)
    if fault == "send" and rank == 0:
        _before(group, "_opened", opened)
    tier = unickpt.MemoryTier(persist_every=100, replicas=2, dir=dirs[rank])
    config = get_config(collective_timeout_s=TIMEOUT_S)
    ckpt = unickpt.Checkpointer(root, keep_last=3, memory=tier, config=config)
    rows = world * ROWS
    make = state_cols if cols else state
    dest = make(-1, rank, world, rows)
    try:
        step = ckpt.load_latest(dest)
    except CheckpointError as e:
        return ("error", str(e))
    assert step is not None and ckpt.last_restore is not None
    check(dest, step, rank, world, rows, cols)
    return (step, ckpt.last_restore.source)


def save_with_a_replica_held(
    rank: int, world: int, root: str, dirs: dict[int, str], nodes: dict[int, str], flags: str
) -> None:
    """Save step 1; then, in a thread, step 2, whose replica rank 1 receives from rank 0 waits
    before its rename until ``flags/open`` exists (``flags/holding`` says it waits there).
    Each rank touches ``flags/returned-<rank>`` once its ``wait()`` of step 2 returned."""
    node_env(rank, nodes)
    flag = Path(flags)

    def hold(src: str, dst: str) -> None:
        if "step-000000002" in dst and dst.endswith("-00000.json"):
            (flag / "holding").touch()
            deadline = time.monotonic() + 300
            while not (flag / "open").exists() and time.monotonic() < deadline:
                time.sleep(0.01)

    if rank == 1:
        _renames(hold)
    tier = unickpt.MemoryTier(persist_every=100, replicas=2, dir=dirs[rank])
    ckpt = unickpt.Checkpointer(root, keep_last=3, memory=tier)
    rows = world * ROWS
    ckpt.save(1, state(1, rank, world, rows)).wait()
    dist.barrier()

    def second() -> None:
        ckpt.save(2, state(2, rank, world, rows)).wait()
        (flag / f"returned-{rank}").touch()

    threading.Thread(target=second, daemon=True).start()
