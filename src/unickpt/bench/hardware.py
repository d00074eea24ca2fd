"""The machine's own limits, measured inside the benchmark job with the same processes.

Every rank writes its share of the checkpoint's bytes to its own file and fsyncs it, then
reads that file back (the page cache is warm: dropping caches needs privileges a benchmark
should not assume), then copies a buffer in memory. Collective: every rank calls
:func:`measure_hardware` at the same point.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from unickpt.bench.measure import now
from unickpt.bench.results import HardwareResult

_CHUNK_BYTES = 16 * 1024 * 1024
_MEMCPY_BYTES = 256 * 1024 * 1024
_MEMCPY_REPEATS = 4


def _timed_collective(work: Callable[[], object]) -> float:
    dist.barrier()
    start = now()
    work()
    dist.barrier()
    return now() - start


def measure_hardware(workdir: Path, local_bytes: int) -> HardwareResult:
    """Write ``local_bytes`` per rank with fsync, read them back, and time a memcpy."""
    world = dist.get_world_size()
    file = workdir / f"hw_{dist.get_rank()}.bin"
    chunk = torch.randint(0, 255, (_CHUNK_BYTES,), dtype=torch.uint8).numpy()
    write_s = _timed_collective(lambda: _write_fsync(file, chunk, local_bytes))
    read_s = _timed_collective(lambda: _read(file, local_bytes))
    file.unlink()
    src = torch.ones(_MEMCPY_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    memcpy_s = _timed_collective(lambda: [dst.copy_(src) for _ in range(_MEMCPY_REPEATS)])
    sizes = torch.tensor([local_bytes], dtype=torch.int64)
    dist.all_reduce(sizes)
    return HardwareResult(
        writers=world,
        total_bytes=int(sizes.item()),
        write_fsync_s=write_s,
        read_warm_s=read_s,
        memcpy_bytes=world * _MEMCPY_REPEATS * _MEMCPY_BYTES,
        memcpy_s=memcpy_s,
    )


def _write_fsync(file: Path, chunk: np.ndarray, total: int) -> None:
    view = memoryview(chunk.tobytes())
    with file.open("wb", buffering=0) as handle:
        left = total
        while left > 0:
            n = min(left, len(view))
            handle.write(view[:n])
            left -= n
        os.fsync(handle.fileno())


def _read(file: Path, total: int) -> None:
    buffer = bytearray(min(total, _CHUNK_BYTES))
    with file.open("rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass
