"""Counters read from /proc: I/O bytes and resident memory of this process and its children.

Children matter: DCP's process executor and some peers write from helper processes. A child
that exits and is reaped has its I/O folded into the parent's counters by the kernel.

* ``write_bytes``: bytes this process tree dirtied in the page cache for storage (files on
  tmpfs such as /dev/shm are not counted); collective traffic is not counted.
* ``rchar``: bytes returned by read-type system calls, page-cache hits included; memory-mapped
  reads are not counted, and neither is gloo's socket traffic (it uses recvmsg).
* ``read_bytes``: bytes fetched from the block device (near zero when the page cache is warm).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

_PROC = Path("/proc")
_PAGE_KIB = 1024
_RESCAN_S = 0.25


@dataclass(frozen=True)
class IoCounters:
    rchar: int = 0
    read_bytes: int = 0
    write_bytes: int = 0

    def __sub__(self, other: IoCounters) -> IoCounters:
        return IoCounters(
            self.rchar - other.rchar,
            self.read_bytes - other.read_bytes,
            self.write_bytes - other.write_bytes,
        )

    def __add__(self, other: IoCounters) -> IoCounters:
        return IoCounters(
            self.rchar + other.rchar,
            self.read_bytes + other.read_bytes,
            self.write_bytes + other.write_bytes,
        )


def _read_io(pid: int) -> IoCounters:
    try:
        text = (_PROC / str(pid) / "io").read_text()
    except OSError:
        return IoCounters()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return IoCounters(
        int(fields.get("rchar", 0)),
        int(fields.get("read_bytes", 0)),
        int(fields.get("write_bytes", 0)),
    )


def _task_children(pid: int) -> list[int] | None:
    """Children of ``pid`` from ``/proc/<pid>/task/*/children`` (a few small reads), or None
    when the kernel does not offer these files."""
    try:
        tasks = list((_PROC / str(pid) / "task").iterdir())
    except OSError:
        return []
    found: list[int] = []
    for task in tasks:
        try:
            text = (task / "children").read_text()
        except FileNotFoundError:
            if not (task / "stat").exists():
                continue  # the thread ended meanwhile
            return None
        except OSError:
            continue
        found.extend(int(field) for field in text.split())
    return found


def _scan_children() -> dict[int, list[int]]:
    """Every process's children, from a scan of all of /proc (slow on a busy machine)."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """Live descendant process ids of ``pid`` (children, grandchildren, ...). Reads each
    process's own children lists where the kernel has them, so its cost grows with this
    process tree, not with every process of the machine (the benchmark calls it while it
    times)."""
    found: list[int] = []
    frontier = [pid]
    scanned: dict[int, list[int]] | None = None
    while frontier:
        parent = frontier.pop()
        nxt = _task_children(parent) if scanned is None else scanned.get(parent, [])
        if nxt is None:
            scanned = _scan_children()
            nxt = scanned.get(parent, [])
        found.extend(nxt)
        frontier.extend(nxt)
    return found


def tree_io(pid: int | None = None) -> dict[int, IoCounters]:
    """I/O counters of ``pid`` (default: this process) and each live descendant."""
    root = os.getpid() if pid is None else pid
    return {p: _read_io(p) for p in [root, *descendants(root)]}


def io_delta(before: dict[int, IoCounters], after: dict[int, IoCounters]) -> IoCounters:
    """Bytes moved between two :func:`tree_io` snapshots; new processes count from zero."""
    total = IoCounters()
    for pid, counters in after.items():
        total = total + (counters - before.get(pid, IoCounters()))
    return total


def _rss_bytes(pid: int) -> int:
    try:
        text = (_PROC / str(pid) / "status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * _PAGE_KIB
    return 0


def _private_bytes(pid: int) -> int:
    """Pages only this process maps (its own allocations and copied-on-write pages)."""
    try:
        text = (_PROC / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return 0
    total = 0
    for line in text.splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1]) * _PAGE_KIB
    return total


def _tree_bytes(root: int, children: list[int]) -> int:
    return _rss_bytes(root) + sum(_private_bytes(p) for p in children)


def tree_rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process plus the private memory of its live descendants (a forked
    helper shares the parent's pages; only what it owns is counted)."""
    root = os.getpid() if pid is None else pid
    return _tree_bytes(root, descendants(root))


def _reset_self_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _self_peak_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * _PAGE_KIB
    return 0


class PeakMemory:
    """Context manager measuring the resident-memory high-water mark above the level at entry.

    Two sources, the larger wins: the kernel's own high-water mark of this process (reset at
    entry through /proc/self/clear_refs, exact), and a thread sampling every ``interval_s`` this
    process's RSS plus the private memory of its helper processes (:func:`tree_rss_bytes`).
    :meth:`split` ends one interval and starts the next without stopping the sampler, so a
    timed stretch pays no thread start or stop in its middle.
    """

    def __init__(self, interval_s: float = 0.01) -> None:
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._baseline_tree = 0
        self._baseline_self = 0
        self._peak_tree = 0
        self._hwm_exact = False
        self._interval = 0  # bumped at each split: a sample read before it belongs to the last
        self.extra_bytes = 0
        self.peak_bytes = 0  # absolute: the level at entry (or at the last split) plus extra

    def __enter__(self) -> PeakMemory:
        self._start(tree_rss_bytes())
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def _start(self, tree_bytes: int) -> None:
        with self._lock:
            self._hwm_exact = _reset_self_peak()
            self._baseline_self = _rss_bytes(os.getpid())
            self._baseline_tree = tree_bytes
            self._peak_tree = tree_bytes
            self._interval += 1

    def _sample(self) -> None:
        root = os.getpid()
        children = descendants(root)
        last_scan = time.monotonic()
        while not self._stop.wait(self._interval_s):
            if time.monotonic() - last_scan > _RESCAN_S:
                children = descendants(root)
                last_scan = time.monotonic()
            with self._lock:
                interval = self._interval
            level = _tree_bytes(root, children)
            with self._lock:
                if interval == self._interval:  # not a level read before a split
                    self._peak_tree = max(self._peak_tree, level)

    def _finish(self, tree_bytes: int) -> None:
        with self._lock:
            self._peak_tree = max(self._peak_tree, tree_bytes)
            sampled = self._peak_tree - self._baseline_tree
            exact = _self_peak_bytes() - self._baseline_self if self._hwm_exact else 0
            self.extra_bytes = max(0, sampled, exact)
            self.peak_bytes = self._baseline_tree + self.extra_bytes

    def split(self) -> int:
        """Inside the block: the absolute peak since entry (or the previous split), then a new
        interval starts at the current level; ``extra_bytes`` and ``peak_bytes`` at exit
        describe the last interval."""
        level = _tree_bytes(os.getpid(), descendants(os.getpid()))
        self._finish(level)
        peak = self.peak_bytes
        self._start(level)
        return peak

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._finish(tree_rss_bytes())


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the kernel (glibc's ``malloc_trim``); False where
    there is no such call.

    Freed memory stays resident until the allocator returns it, and it does so when it
    chooses: a level of resident memory taken with free pages in the heap can fall later by
    itself, and an allocation that reuses those pages raises nothing. Trimming before each
    level is taken makes "peak above the level" count what the measured step allocates.
    """
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True


def settle() -> None:
    """Before a timed step: collect the interpreter's garbage cycles, then trim the heap.

    A full collection comes due from the allocations of everything before it and runs, holding
    the interpreter lock, in whichever step allocates next: in a 100M-parameter FSDP2 job (about
    325,000 objects) it takes about 0.2 s and landed in the middle of rank 0's resharded load in
    about half the runs, stalling every thread of the load. Collected before each timed step,
    every system pays for the collections its own allocations cause and for none due from
    earlier steps.
    """
    gc.collect()
    trim_heap()


def now() -> float:
    return time.perf_counter()
