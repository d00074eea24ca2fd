"""A byte buffer reused by each thread, grown as needed.

Fresh pages for every piece would cost a page fault and the kernel's zeroing per 4 KiB.
"""

from __future__ import annotations

import threading

import torch


class Scratch(threading.local):
    """One uint8 buffer per thread; :meth:`take` returns its first ``size`` bytes."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, size: int) -> torch.Tensor:
        if self.buffer.numel() < size:
            self.buffer = torch.empty(size, dtype=torch.uint8)
        return self.buffer[:size]
