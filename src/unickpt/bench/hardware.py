"""The machine's own limits, measured inside the benchmark job with the same processes.

Every rank writes its share of the checkpoint's bytes to its own file with 4 threads and
fsyncs it, then reads that file back with 4 threads (the page cache is warm: dropping caches
needs privileges a benchmark should not assume), then copies a buffer in memory; with the state
on CUDA, it also copies a buffer from the GPU into pinned host memory and back (the bandwidth
a snapshot and a load of GPU tensors can reach). Collective: every rank calls
:func:`measure_hardware` at the same point.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from unickpt.bench.measure import now
from unickpt.bench.results import HardwareResult

_CHUNK_BYTES = 16 * 1024 * 1024
_MEMCPY_BYTES = 256 * 1024 * 1024
_IO_THREADS = 4
_WRITE_REPEATS = 2
_REPEATS = 3


def _timed_collective(work: Callable[[], object]) -> float:
    dist.barrier()
    start = now()
    work()
    dist.barrier()
    return now() - start


def _best(work: Callable[[], object], repeats: int) -> float:
    return min(_timed_collective(work) for _ in range(repeats))


def measure_hardware(workdir: Path, local_bytes: int, device: str = "cpu") -> HardwareResult:
    """Write ``local_bytes`` per rank with fsync, read them back, and time a memcpy (and, with
    ``device`` ``"cuda"``, a device-to-host and a host-to-device copy through pinned memory);
    each the best of a few tries, since the limit is what the machine can do at its best."""
    world = dist.get_world_size()
    file = workdir / f"hw_{dist.get_rank()}.bin"
    chunk = torch.randint(0, 255, (_CHUNK_BYTES,), dtype=torch.uint8).numpy().tobytes()
    write_s = _best(lambda: _write_fsync(file, chunk, local_bytes), _WRITE_REPEATS)
    read_s = _best(lambda: _read(file, local_bytes), _REPEATS)
    file.unlink()
    src = torch.ones(_MEMCPY_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    memcpy_s = _best(lambda: dst.copy_(src), _REPEATS)
    d2h_s, h2d_s = _device_copies() if device == "cuda" else (0.0, 0.0)
    sizes = torch.tensor([local_bytes], dtype=torch.int64)
    dist.all_reduce(sizes)
    return HardwareResult(
        writers=world,
        total_bytes=int(sizes.item()),
        write_fsync_s=write_s,
        read_warm_s=read_s,
        memcpy_bytes=world * _MEMCPY_BYTES,
        memcpy_s=memcpy_s,
        device_copy_bytes=world * _MEMCPY_BYTES if device == "cuda" else 0,
        d2h_s=d2h_s,
        h2d_s=h2d_s,
    )


def _device_copies() -> tuple[float, float]:
    """Seconds of the best device-to-host and host-to-device copy of ``_MEMCPY_BYTES`` between
    this rank's GPU and pinned host memory, every rank copying at once."""
    gpu = torch.ones(_MEMCPY_BYTES // 4, dtype=torch.float32, device="cuda")
    host = torch.empty(gpu.shape, dtype=gpu.dtype, pin_memory=True)

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    copy(host, gpu)
    d2h_s = _best(lambda: copy(host, gpu), _REPEATS)
    h2d_s = _best(lambda: copy(gpu, host), _REPEATS)
    return d2h_s, h2d_s


def _ranges(total: int) -> list[tuple[int, int]]:
    """Split ``[0, total)`` into one contiguous range per I/O thread."""
    step = -(-total // _IO_THREADS)
    return [(start, min(step, total - start)) for start in range(0, total, step)]


def _write_fsync(file: Path, chunk: bytes, total: int) -> None:
    view = memoryview(chunk)
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        def write_range(start: int, length: int) -> None:
            done = 0
            while done < length:
                n = min(length - done, len(view))
                done += os.pwrite(fd, view[:n], start + done)

        with ThreadPoolExecutor(_IO_THREADS) as pool:
            list(pool.map(lambda r: write_range(*r), _ranges(total)))
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(file: Path, total: int) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:

        def read_range(start: int, length: int) -> None:
            buffer = bytearray(min(length, _CHUNK_BYTES))
            done = 0
            while done < length:
                n = os.preadv(
                    fd, [memoryview(buffer)[: min(length - done, len(buffer))]], start + done
                )
                if n == 0:
                    return
                done += n

        with ThreadPoolExecutor(_IO_THREADS) as pool:
            list(pool.map(lambda r: read_range(*r), _ranges(total)))
    finally:
        os.close(fd)
