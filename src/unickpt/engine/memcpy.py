"""Host copies, and which threads run them.

Many small ``Tensor.copy_`` calls each open an OpenMP parallel region; on a busy machine
(training threads, data loaders) their barriers cost far more than the copy. Contiguous CPU
copies go through NumPy instead (a plain memcpy that releases the GIL), and several of them
run side by side on the engine's own threads. The exception: a copy of at least
``LARGE_COPY_BYTES`` made while the caller waits for it, where torch's intra-op threads are
faster, as long as the intra-op threads of every rank on the host fit its cores
(:func:`intra_op_fits`).

Rows are copied one memcpy per row (:func:`copy_rows`). glibc copies with ``rep movsb`` from
``REP_MOVSB_BYTES`` on processors with fast short ``rep movsb`` (FSRM), and with vector stores
below; on the development machine 96 MiB of 1.5 KiB half rows took 17-19 ms that way against
10-12 ms as 3 KiB copies. Where rows shorter than that lie at most twice their length apart in
the source and back to back in the destination (half of every row of a saved chunk, loaded
into ``Shard(1)``), each row is copied together with the source bytes up to the next row, into
the next row's place, which the next row's copy then overwrites: one copy of at least the
threshold per row, from a source read straight through (:func:`copy_host_rows`).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from ..format.dtypes import byte_view

# One parallel region per copy costs a few microseconds; at 1 MiB that is under 1% of the copy.
LARGE_COPY_BYTES = 1 << 20


def intra_op_fits() -> bool:
    """Whether torch's intra-op threads of every rank on this host fit its cores together.

    Ranks per host: ``LOCAL_WORLD_SIZE`` (set by torchrun), else the whole process group (an
    upper bound). Oversubscribed, the intra-op threads' barriers spin against the other ranks'
    threads: with 2 ranks of 2 threads on 2 cores a 256 MiB snapshot took 100-118 ms through
    them against 68-70 ms on the engine's threads.
    """
    threads = torch.get_num_threads()
    if threads < 2:
        return False
    ranks = _local_world_size()
    if ranks is None:
        dist = torch.distributed
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return threads * ranks <= len(os.sched_getaffinity(0))


def copy_threads(wanted: int) -> int:
    """Threads for host copies that keep this rank within its share of the host's cores:
    ``wanted``, at most the cores this process may use divided among the host's ranks
    (``LOCAL_WORLD_SIZE``; unset, the process counts as alone), never fewer than one. Copies out
    of memory are bound by the cores, so a thread more than that only waits its turn (and its
    start costs about a millisecond on a busy host)."""
    return max(1, min(wanted, len(os.sched_getaffinity(0)) // (_local_world_size() or 1)))


def _local_world_size() -> int | None:
    """``LOCAL_WORLD_SIZE`` when it is set to a positive number (unreadable counts as unset)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def copy_tensor(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for same-shaped, same-dtype tensors, memcpy when both allow it."""
    if (
        src.device.type == "cpu"
        and dst.device.type == "cpu"
        and src.is_contiguous()
        and dst.is_contiguous()
        and src.dtype == dst.dtype
    ):
        np.copyto(byte_view(dst).numpy(), byte_view(src).numpy())
    else:
        dst.copy_(src, non_blocking=non_blocking)


_MAX_ROW_BYTES = 2**30  # NumPy's void items are limited in size; longer rows copy as bytes


def host_rows(t: torch.Tensor) -> np.ndarray | None:
    """A NumPy view of a CPU tensor whose last dimension is contiguous, one opaque item per
    row (so that copying it is one memcpy per row); None where torch must copy it."""
    if t.device.type != "cpu" or t.dim() == 0 or t.stride(-1) != 1 or t.numel() == 0:
        return None
    t = t.detach()
    run = t.shape[-1] * t.element_size()
    if run > _MAX_ROW_BYTES:
        return None
    try:
        raw = t if t.dtype == torch.uint8 else t.view(torch.uint8)
    except RuntimeError:
        return None
    return raw.numpy().view(np.dtype((np.void, run)))  # type: ignore[no-any-return]


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-shaped, same-dtype tensors; CPU tensors whose rows are
    contiguous are copied one memcpy per row through NumPy (no OpenMP region), others by torch.
    """
    d = host_rows(dst) if dst.dtype == src.dtype else None
    s = host_rows(src) if d is not None else None
    if d is None or s is None:
        dst.copy_(src)
    else:
        copy_host_rows(d, s)


REP_MOVSB_BYTES = 2112
"""glibc's default threshold for ``rep movsb`` on processors with fast short ``rep movsb``."""


def copy_host_rows(d: np.ndarray, s: np.ndarray) -> None:
    """``np.copyto(d, s)`` for row views made by :func:`host_rows`; rows shorter than
    ``REP_MOVSB_BYTES`` whose source rows lie at least that far apart, and less than twice their
    length at most, are copied as longer, overlapping rows (see the module's docstring)."""
    if not _overlaps_pay(d, s):
        np.copyto(d, s)
        return
    _copy_overlapped(d, s)


def _overlaps_pay(d: np.ndarray, s: np.ndarray) -> bool:
    """Whether ``d`` (a matrix of rows by one void item, rows back to back) takes ``s`` faster as
    overlapping copies, and this process copies such items in ascending order."""
    if d.ndim != 2 or d.shape != s.shape or d.shape[0] < 2 or d.shape[1] != 1:
        return False
    run, step = d.itemsize, s.strides[0]
    if d.strides[0] != run or not run < REP_MOVSB_BYTES <= step <= 2 * run:
        return False
    if np.may_share_memory(d, s):  # the overlap would write over rows still to be read
        return False
    return _fast_short_rep_movsb() and _ascending_overlaps()


def _copy_overlapped(d: np.ndarray, s: np.ndarray) -> None:
    """Rows ``0 .. n-2`` of ``s`` copied with the bytes up to the next row (one source stride
    each), into ``d``'s row and the start of the next, which the next row's copy overwrites;
    the last row alone. ``d``'s rows lie back to back; its rows never overlap ``s``."""
    n, run, step = d.shape[0], d.itemsize, s.strides[0]
    wide = np.dtype((np.void, step))
    to = as_strided(d.view(np.uint8), (n - 1, step), (run, 1)).view(wide)
    of = as_strided(s.view(np.uint8), (n - 1, step), (step, 1)).view(wide)
    np.copyto(to, of)
    np.copyto(d[n - 1 :], s[n - 1 :])


@functools.cache
def _ascending_overlaps() -> bool:
    """Whether NumPy copies the items of a one-dimensional view in ascending order, which
    overlapping destination items rely on: checked once on a small example, never assumed."""
    run, step, n = 40, 72, 9
    src = np.arange(n * step, dtype=np.uint32).astype(np.uint8).reshape(n, step)
    rows = np.dtype((np.void, run))
    d = np.zeros((n, run), dtype=np.uint8)
    _copy_overlapped(d.view(rows), src[:, :run].view(rows))
    return bool(np.array_equal(d, src[:, :run]))


@functools.cache
def _fast_short_rep_movsb() -> bool:
    """Whether this processor announces fast short ``rep movsb`` (Linux on x86: the ``fsrm`` flag
    of ``/proc/cpuinfo``), with which glibc copies with it from ``REP_MOVSB_BYTES``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "fsrm" in line.split()
    except OSError:
        pass
    return False
