"""Host copies, and which threads run them.

Many small ``Tensor.copy_`` calls each open an OpenMP parallel region; on a busy machine
(training threads, data loaders) their barriers cost far more than the copy. CPU copies go
through NumPy instead (:func:`copy_elements`, which releases the GIL), and several of them run
side by side on the engine's own threads. The exception: a copy of at least
``LARGE_COPY_BYTES`` made while the caller waits for it, where torch's intra-op threads are
faster, as long as the intra-op threads of every rank on the host fit its cores
(:func:`intra_op_fits`).

Parts of saved chunks (half of every row, in a load into another layout) are copied by NumPy
element by element in their own layouts (:func:`copy_elements`): its strided loops were faster
than one ``memcpy`` per row through row views. Half rows still cost more per byte than whole
chunks (``benchmarks/reshard_floor.py``).
"""

from __future__ import annotations

import os

import numpy as np
import torch

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


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def elements(t: torch.Tensor) -> np.ndarray | None:
    """A NumPy view of a CPU tensor's elements, in its layout, each as an integer of its size (so
    that bfloat16 and float8 copy bit for bit); None where torch must copy it."""
    kind = _SAME_SIZE_INTS.get(t.element_size())
    if t.device.type != "cpu" or kind is None:
        return None
    try:
        return t.detach().view(kind).numpy()  # type: ignore[no-any-return]
    except (RuntimeError, TypeError):  # conjugate or negative views, which NumPy cannot take
        return None


def copy_elements(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for same-shaped tensors: CPU tensors of one dtype by NumPy (no OpenMP
    region, the interpreter lock released), others by torch."""
    d = elements(dst) if dst.dtype == src.dtype else None
    s = elements(src) if d is not None else None
    if d is None or s is None:
        dst.copy_(src, non_blocking=non_blocking)
    else:
        np.copyto(d, s)
