"""Host copies, and which threads run them.

Many small ``Tensor.copy_`` calls each open an OpenMP parallel region; on a busy machine
(training threads, data loaders) their barriers cost far more than the copy. Contiguous CPU
copies go through NumPy instead (a plain memcpy that releases the GIL), and several of them
run side by side on the engine's own threads. The exception: a copy of at least
``LARGE_COPY_BYTES`` made while the caller waits for it, where torch's intra-op threads are
faster, as long as the intra-op threads of every rank on the host fit its cores
(:func:`intra_op_fits`).
"""

from __future__ import annotations

import os

import numpy as np
import torch

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
    return threads * _ranks_on_host() <= len(os.sched_getaffinity(0))


def copy_threads(wanted: int) -> int:
    """Threads for host copies that keep this rank within its share of the host's cores:
    ``wanted``, at most the cores this process may use divided among the host's ranks
    (``LOCAL_WORLD_SIZE``; unset, the process counts as alone), never fewer than one. Copies out
    of memory are bound by the cores, so a thread more than that only waits its turn (and its
    start costs about a millisecond on a busy host)."""
    return max(1, min(wanted, len(os.sched_getaffinity(0)) // (_local_world_size() or 1)))


def _ranks_on_host() -> int:
    """``LOCAL_WORLD_SIZE`` (set by torchrun), else the whole process group (an upper bound)."""
    local = _local_world_size()
    if local is None:
        dist = torch.distributed
        local = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return local


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
        np.copyto(d, s)
