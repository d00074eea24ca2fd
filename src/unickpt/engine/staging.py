"""Snapshot buffers: host memory allocated once and reused by every asynchronous save.

A snapshot copies each chunk a rank writes into its place in one arena laid out exactly like
the rank's data file, so the background writer needs no further copy. CUDA tensors are copied
device-to-host asynchronously into pinned memory, with one synchronization at the end.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ..planning.save_plan import WriteItem
from .memcpy import copy_tensor
from .write import ItemSource


class StagingArena:
    """A growable host buffer; reallocated only when a save needs more than it holds."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            if self._buf is None or self._buf.numel() < nbytes or (pinned and not self._pinned):
                self._buf = None
                self._buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
                self._pinned = pinned
            return self._buf[:nbytes]

    def release(self) -> None:
        with self._lock:
            self._buf = None


ARENA = StagingArena()

# Copy threads live across saves: starting them costs more than a copy of tens of MB. Recreated
# after a fork (the child has none of the parent's threads) or when the thread count changes.
_POOL: tuple[int, int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] != threads:
            if _POOL is not None and _POOL[0] == os.getpid():
                _POOL[2].shutdown(wait=False)
            pool = ThreadPoolExecutor(threads, thread_name_prefix="unickpt-snap")
            _POOL = (os.getpid(), threads, pool)
        return _POOL[2]


def needs_pinned(views: Sequence[torch.Tensor]) -> bool:
    return any(v.device.type == "cuda" for v in views) and torch.cuda.is_available()


def snapshot(
    items: Sequence[WriteItem],
    views: Sequence[torch.Tensor],
    arena: StagingArena,
    threads: int = 2,
) -> list[ItemSource]:
    """Copy every item into the arena; return sources that read from the arena."""
    total = items[-1].byte_offset + items[-1].nbytes if items else 0
    pinned = needs_pinned(views)
    buf = arena.take(total, pinned)
    slots = [
        buf[i.byte_offset : i.byte_offset + i.nbytes].view(v.dtype).view(v.shape)
        for i, v in zip(items, views)
    ]
    pairs = list(zip(slots, views))
    with torch.no_grad():
        if pinned or len(pairs) < 2 or threads == 1:
            for dst, src in pairs:
                copy_tensor(dst, src, non_blocking=pinned)
        else:
            batches = _batches(pairs, threads)
            list(_pool(threads).map(_copy_all, batches))
    if pinned:
        torch.cuda.synchronize()
    return [ItemSource(s) for s in slots]


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        copy_tensor(dst, src)


def _batches(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], n: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Split copies into ``n`` groups of about equal bytes (largest first, greedy)."""
    groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]
    loads = [0] * n
    for pair in sorted(pairs, key=lambda p: -p[0].nbytes):
        i = loads.index(min(loads))
        groups[i].append(pair)
        loads[i] += pair[0].nbytes
    return [g for g in groups if g]
