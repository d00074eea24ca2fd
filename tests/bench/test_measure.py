"""The /proc counters the benchmark reads: a process tree found as a full scan of /proc finds
it, and peak memory split into intervals without stopping the sampler."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import time
import weakref

import torch

from unickpt.bench.measure import (
    PeakMemory,
    _rss_bytes,
    _scan_children,
    descendants,
    settle,
    trim_heap,
)

_MiB = 1 << 20


def _tree_by_scan(pid: int) -> list[int]:
    children = _scan_children()
    found: list[int] = []
    frontier = [pid]
    while frontier:
        nxt = children.get(frontier.pop(), [])
        found += nxt
        frontier += nxt
    return found


def test_descendants_are_the_whole_tree() -> None:
    # Two children, each with two children of its own (a shell running two sleeps); the test
    # process may have other children of its own, so the check is on these subtrees.
    procs = [subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30; wait"]) for _ in range(2)]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(len(descendants(p.pid)) < 2 for p in procs):
            time.sleep(0.05)
        found = set(descendants(os.getpid()))
        for proc in procs:
            below = descendants(proc.pid)
            assert len(below) == 2
            assert sorted(below) == sorted(_tree_by_scan(proc.pid))
            assert {proc.pid, *below} <= found
    finally:
        for proc in procs:
            for pid in descendants(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()


def _touch(mib: int) -> torch.Tensor:
    return torch.ones(mib * _MiB, dtype=torch.uint8)  # every page written


def test_peak_memory_split_into_intervals() -> None:
    # Both buffers are above malloc's largest mmap threshold (32 MiB), so each gets new pages:
    # a smaller one could reuse pages an earlier test freed into the heap, and add nothing.
    with PeakMemory() as memory:
        big = _touch(128)
        del big
        first = memory.split()
        small = _touch(48)
        del small
    # The first interval saw the 128 MiB buffer; the second, which starts at the level of the
    # split (its peak less its extra), only the 48 MiB one.
    level_at_split = memory.peak_bytes - memory.extra_bytes
    assert first - level_at_split >= 120 * _MiB
    assert 47 * _MiB <= memory.extra_bytes < 100 * _MiB


def test_trim_heap_returns_freed_pages() -> None:
    pieces = [torch.ones(64 * 1024, dtype=torch.uint8) for _ in range(4096)]  # 256 MiB
    del pieces[::2]  # holes inside the heap: the allocator keeps them resident
    # this process alone: a helper process of an earlier test may grow or shrink meanwhile
    before = _rss_bytes(os.getpid())
    assert trim_heap()
    assert before - _rss_bytes(os.getpid()) >= 96 * _MiB  # of the 128 MiB freed
    del pieces


class _Node:
    def __init__(self) -> None:
        self.me = self


def test_settle_collects_garbage_cycles_before_a_timed_step() -> None:
    gc.disable()  # no collection may run on its own between the cycle's making and settle
    try:
        cycle = _Node()
        gone = weakref.ref(cycle)
        del cycle
        assert gone() is not None  # unreachable, but only the cycle collector frees it
        settle()
        assert gone() is None
    finally:
        gc.enable()
