"""The whole snapshot: every chunk a rank writes copied into host memory laid out like its file.

Each chunk is copied into its place in a room laid out exactly like the rank's data file (the
save queue's staging memory, :mod:`unickpt.saving.queue`), so the background writer needs no
further copy. CUDA tensors are copied device-to-host asynchronously into pinned memory, with
one synchronization at the end.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from ..planning.save_plan import WriteItem
from .memcpy import LARGE_COPY_BYTES, copy_elements, intra_op_fits
from .sources import ItemSource, needs_pinned

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


def stream_marker() -> torch.cuda.Event | None:
    """A CUDA event recorded now on the caller's current stream (None without CUDA work).

    A copy made later from another thread runs on that thread's stream; waiting for the marker
    first means every kernel the caller had queued before the call has run.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def snapshot(
    items: Sequence[WriteItem],
    views: Sequence[torch.Tensor],
    room: torch.Tensor,
    threads: int = 2,
    check: Callable[[int], None] | None = None,
    intra_op: bool = False,
) -> list[ItemSource]:
    """Copy every item into ``room`` (host bytes, pinned for CUDA sources, at least the file's
    size); return sources that read from it.

    ``check(i)``, when given, runs once item ``i`` is copied (for CUDA: once every copy has
    finished); an error it raises stops the remaining copies and is raised here, after every
    copy thread has let go of the room. With ``intra_op`` (the caller's thread is blocked on
    the copy anyway, as in a foreground snapshot) and :func:`intra_op_fits`, host copies of at
    least ``LARGE_COPY_BYTES`` run one after another on torch's intra-op threads, which copy
    large buffers faster than separate threads each copying their own (see the snapshot step
    in ``docs/architecture.md``); the rest run on the engine's copy threads.
    """
    pinned = needs_pinned(views)
    jobs = [
        (i, room[it.byte_offset : it.byte_offset + it.nbytes].view(v.dtype).view(v.shape), v)
        for i, (it, v) in enumerate(zip(items, views))
    ]
    with torch.no_grad():
        if pinned:
            for _, dst, src in jobs:
                copy_elements(dst, src, non_blocking=True)
            torch.cuda.synchronize()
            if check is not None:
                for i, _, _ in jobs:
                    check(i)
        else:
            rest = _copy_large(jobs, check) if intra_op and intra_op_fits() else jobs
            if len(rest) < 2 or threads == 1:
                _copy_all(rest, check, threading.Event())
            else:  # on the copy threads, in batches of about equal bytes
                stop = threading.Event()
                batches = _batches(rest, threads)
                futures = [_pool(threads).submit(_copy_all, b, check, stop) for b in batches]
                wait(futures)
                for f in futures:
                    if (error := f.exception()) is not None:
                        raise error
    return [ItemSource(dst) for _, dst, _ in jobs]


_Job = tuple[int, torch.Tensor, torch.Tensor]


def _copy_large(jobs: list[_Job], check: Callable[[int], None] | None) -> list[_Job]:
    """Copy the large host jobs with ``Tensor.copy_`` (split across torch's intra-op threads)
    and return the others."""
    rest = []
    for i, dst, src in jobs:
        if src.device.type == "cpu" and src.nbytes >= LARGE_COPY_BYTES:
            dst.copy_(src)
            if check is not None:
                check(i)
        else:
            rest.append((i, dst, src))
    return rest


def _copy_all(jobs: list[_Job], check: Callable[[int], None] | None, stop: threading.Event) -> None:
    for i, dst, src in jobs:
        if stop.is_set():
            return
        try:
            copy_elements(dst, src)
            if check is not None:
                check(i)
        except BaseException:
            stop.set()
            raise


def _batches(jobs: list[_Job], n: int) -> list[list[_Job]]:
    """Split copies into ``n`` groups of about equal bytes (largest first, greedy)."""
    groups: list[list[_Job]] = [[] for _ in range(n)]
    loads = [0] * n
    for job in sorted(jobs, key=lambda j: -j[1].nbytes):
        i = loads.index(min(loads))
        groups[i].append(job)
        loads[i] += job[1].nbytes
    return [g for g in groups if g]
