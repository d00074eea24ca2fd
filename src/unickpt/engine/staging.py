"""Snapshot buffers: host memory allocated once and reused by every asynchronous save.

A snapshot copies each chunk a rank writes into its place in one arena laid out exactly like
the rank's data file, so the background writer needs no further copy. CUDA tensors are copied
device-to-host asynchronously into pinned memory, with one synchronization at the end.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from ..planning.save_plan import WriteItem
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


def needs_pinned(views: Sequence[torch.Tensor]) -> bool:
    return any(v.device.type == "cuda" for v in views) and torch.cuda.is_available()


def snapshot(
    items: Sequence[WriteItem], views: Sequence[torch.Tensor], arena: StagingArena
) -> list[ItemSource]:
    """Copy every item into the arena; return sources that read from the arena."""
    total = items[-1].byte_offset + items[-1].nbytes if items else 0
    pinned = needs_pinned(views)
    buf = arena.take(total, pinned)
    sources = []
    with torch.no_grad():
        for item, view in zip(items, views):
            slot = buf[item.byte_offset : item.byte_offset + item.nbytes]
            typed = slot.view(view.dtype).view(view.shape)
            typed.copy_(view, non_blocking=pinned)
            sources.append(ItemSource(typed))
    if pinned:
        torch.cuda.synchronize()
    return sources
