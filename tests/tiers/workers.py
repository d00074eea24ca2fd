"""Rank functions of the memory tier's process tests (importable by spawned processes)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import unickpt

ROWS = 8  # rows of the global matrix per rank of the saving job (4 ranks)
COLS = 300


def full(step: int, ranks: int = 4) -> torch.Tensor:
    """The global matrix of ``step`` (every value depends on the step)."""
    return torch.arange(ranks * ROWS * COLS, dtype=torch.float32).reshape(-1, COLS) * 0.5 + step


def state(step: int, rank: int, world: int, rows: int) -> dict[str, Any]:
    """Rank ``rank`` of ``world`` holds an even block of ``rows`` rows; the bias is replicated
    (written once, by one rank, so other ranks read it from another rank's file)."""
    per = rows // world
    w = full(step, rows // ROWS)
    block = w[rank * per : (rank + 1) * per].clone()
    return {
        "w": unickpt.ShardedTensor(block, (rows, COLS), (rank * per, 0)),
        "b": torch.full((17,), float(step)),
        "step": step,
    }


def state_cols(step: int, rank: int, world: int, rows: int) -> dict[str, Any]:
    """:func:`state` split by columns instead: every rank needs part of every saved row."""
    per = COLS // world
    block = full(step, rows // ROWS)[:, rank * per : (rank + 1) * per].clone()
    return {
        "w": unickpt.ShardedTensor(block, (rows, COLS), (0, rank * per)),
        "b": torch.full((17,), float(step)),
        "step": step,
    }


def check(
    loaded: dict[str, Any], step: int, rank: int, world: int, rows: int, cols: bool = False
) -> None:
    want = (state_cols if cols else state)(step, rank, world, rows)
    assert torch.equal(loaded["w"].local, want["w"].local), f"rank {rank}: w differs"
    assert torch.equal(loaded["b"], want["b"]), f"rank {rank}: b differs"
    assert loaded["step"] == step


def node_env(rank: int, nodes: dict[int, str] | None) -> None:
    if nodes is not None:
        os.environ["UNICKPT_NODE"] = nodes[rank]


def save_steps(
    rank: int,
    world: int,
    root: str,
    dirs: dict[int, str],
    nodes: dict[int, str] | None,
    steps: list[int],
    persist_every: int,
) -> list[str]:
    """Save ``steps`` through a memory tier; the memory folder's names afterwards."""
    node_env(rank, nodes)
    tier = unickpt.MemoryTier(persist_every=persist_every, replicas=2, dir=dirs[rank])
    ckpt = unickpt.Checkpointer(root, keep_last=3, memory=tier)
    rows = world * ROWS
    for step in steps:
        ckpt.save(step, state(step, rank, world, rows))
    ckpt.wait()
    persisted(ckpt)
    dist.barrier()
    return sorted(str(p.relative_to(dirs[rank])) for p in Path(dirs[rank]).rglob("*"))


def persisted(ckpt: unickpt.Checkpointer) -> None:
    """Wait for the memory tier's running persist to storage, if any (saves do not)."""
    tier = ckpt._tier
    running = tier._persist if tier is not None else None
    if running is not None:
        running.join()


def restart(
    rank: int,
    world: int,
    root: str,
    dirs: dict[int, str],
    nodes: dict[int, str] | None,
    rows: int,
    close: bool,
    cols: bool = False,
    received: bool = False,
) -> tuple[Any, ...]:
    """Load the newest step into this layout (split by columns with ``cols``), check it
    exactly; (step, source), and with ``received`` the files this rank got from other nodes."""
    node_env(rank, nodes)
    tier = unickpt.MemoryTier(persist_every=100, replicas=2, dir=dirs[rank])
    ckpt = unickpt.Checkpointer(root, keep_last=3, memory=tier)
    dest = (state_cols if cols else state)(-1, rank, world, rows)
    step = ckpt.load_latest(dest)
    info = ckpt.last_restore
    assert info is not None and info.seconds > 0
    if step is not None:
        check(dest, step, rank, world, rows, cols)
    if close:
        ckpt.close()
    return (step, info.source, info.peer_files) if received else (step, info.source)


def train_until_signalled(rank: int, world: int, root: str, shm: str, ready: str) -> None:
    """Save every step inside a guard until SIGTERM ends the process."""
    tier = unickpt.MemoryTier(persist_every=1000, replicas=2, dir=shm, persist_deadline_s=60)
    ckpt = unickpt.Checkpointer(root, keep_last=3, memory=tier)
    rows = world * ROWS
    with ckpt.guard():
        step = 0
        while True:
            step += 1
            ckpt.save(step, state(step, rank, world, rows))
            time.sleep(0.05)  # the training step
            if step == 3:
                Path(ready, f"rank{rank}").touch()


def entry_signalled(rank: int, world: int, port: int, root: str, shm: str, ready: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    train_until_signalled(rank, world, root, shm, ready)


def restart_in_pieces(
    rank: int,
    world: int,
    root: str,
    dirs: dict[int, str],
    nodes: dict[int, str] | None,
    rows: int,
    piece: int,
    cols: bool = False,
) -> tuple[int | None, str, list[str]]:
    """:func:`restart` with files sent in pieces of ``piece`` bytes; also the files in this
    rank's memory folder afterwards."""
    from unickpt.tiers import group

    group.PIECE_BYTES = piece
    step, source = restart(rank, world, root, dirs, nodes, rows, False, cols)
    folder = Path(dirs[rank])
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    return step, source, names
