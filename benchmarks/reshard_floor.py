"""The memory traffic a resharded load cannot avoid, against a same-layout load's, on one host.

Two processes (ranks) load a ``--mib`` MiB float32 matrix of ``--cols`` columns (768: the rows
of the 100M benchmark's GPT, 3 KiB) that lies in the page cache as two halves, one saved by
each rank (``Shard(0)``), with 1 MiB checksum segments, into tensors that torch allocated (as a
load's destinations are: torch backs large tensors with huge pages, which makes a ``pread``
into them about 1.7x faster than into 4 KiB pages):

- **same layout**: each rank reads its own half (``pread`` of 1 MiB segments into place) and
  hashes each segment right after it lands (in cache), as unickpt's plain load does;
- **resharded** (``Shard(1)``): each rank needs half of every row of both halves. From one
  mapping of the file, each rank hashes the segments of its own half (it owns them) and copies
  its half rows out of each right after hashing it, then copies its half rows out of the other
  rank's half, which that rank verifies: each byte hashed once, each byte needed copied once,
  no buffer of its own, as unickpt's resharded load on one host does.

Two more ways measure the other layout of the same bytes, chunks smaller than a shard (as
Orbax saves them): each half saved as column tiles, a block of rows as its left halves then
its right halves, each tile about 1 MiB and one checksum segment:

- **tiled, same layout** (``tiled_same``): a tile lands as half rows of the rank's rows, so each
  is read into a buffer, hashed there and copied into place;
- **tiled, resharded** (``tiled_reshard``): a rank's tiles land whole in its rows, read and
  hashed in place as the same-layout load's segments are.

The tiled file makes the resharded load cost what a same-layout load costs today and the
same-layout load what a resharded one does: the bytes are stored in one order, and whichever
layout does not match it copies half rows.

No planning, no threads, no Python between bytes beyond one call per segment: the floor of each
way. Times are per rank, medians of ``--rounds`` rounds, both ranks running at once; each
ratio divides by the same-layout load of the file as saved today.

python benchmarks/reshard_floor.py --mib 1280 --cols 768 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
import xxhash

MIB = 1 << 20


def _same(fd: int, rank: int, half: int, out: np.ndarray) -> None:
    view = memoryview(out)
    for off in range(0, half, MIB):
        os.preadv(fd, [view[off : off + MIB]], rank * half + off)
        xxhash.xxh3_64_hexdigest(view[off : off + MIB])


def _reshard(fd: int, rank: int, size: int, out: np.ndarray, cols: int) -> None:
    rows = size // (cols * 4)
    half_rows, seg_rows = rows // 2, MIB // (cols * 4)
    mapped = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    src = np.frombuffer(mapped, dtype=np.float32).reshape(rows, cols)
    raw = memoryview(mapped)
    half = slice(0, cols // 2) if rank == 0 else slice(cols // 2, cols)
    mine, theirs = rank * half_rows, (1 - rank) * half_rows
    for r in range(0, half_rows, seg_rows):
        e = min(half_rows, r + seg_rows)
        xxhash.xxh3_64_hexdigest(raw[(mine + r) * cols * 4 : (mine + e) * cols * 4])
        np.copyto(out[mine + r : mine + e], src[mine + r : mine + e, half])
    for r in range(0, half_rows, 16 * seg_rows):
        e = min(half_rows, r + 16 * seg_rows)
        np.copyto(out[theirs + r : theirs + e], src[theirs + r : theirs + e, half])
    del src, raw
    mapped.close()


def _tile_rows(cols: int) -> int:
    """Rows of a column tile: half of each row, about 1 MiB in all."""
    return MIB // (cols * 2)


def _tiled_same(fd: int, rank: int, half: int, out: np.ndarray, cols: int) -> None:
    """A same-layout load of a half saved as column tiles (each block of rows as its left
    halves, then its right halves, each tile one checksum segment): a tile lands as half rows,
    so it is read into a buffer, hashed there, then copied into place."""
    k = _tile_rows(cols)
    scratch = np.empty(k * cols // 2, dtype=np.float32)
    tile = memoryview(scratch).cast("B")
    for n in range(half // len(tile)):
        os.preadv(fd, [tile], rank * half + n * len(tile))
        xxhash.xxh3_64_hexdigest(tile)
        block, side = divmod(n, 2)
        where = slice(0, cols // 2) if side == 0 else slice(cols // 2, cols)
        np.copyto(out[block * k : (block + 1) * k, where], scratch.reshape(k, cols // 2))


def _tiled_reshard(fd: int, rank: int, half: int, out: np.ndarray, cols: int) -> None:
    """The resharded load of the same tiles: a rank's tiles (one of each pair, in both halves)
    land whole in its rows, read and hashed in place as a same-layout load's segments are."""
    view = memoryview(out).cast("B")
    nbytes = _tile_rows(cols) * cols * 2
    pos = 0
    for h in (0, 1):
        for n in range(rank, half // nbytes, 2):
            os.preadv(fd, [view[pos : pos + nbytes]], h * half + n * nbytes)
            xxhash.xxh3_64_hexdigest(view[pos : pos + nbytes])
            pos += nbytes


CASES = ("same", "reshard", "tiled_same", "tiled_reshard")


def _rank(rank: int, path: str, size: int, cols: int, rounds: int, barrier: Any, q: Any) -> None:
    fd = os.open(path, os.O_RDONLY)
    torch.set_num_threads(1)
    same_out = torch.ones(size // 2, dtype=torch.uint8).numpy()
    reshard_out = torch.ones(size // (cols * 4), cols // 2).numpy()
    half = size // 2
    run = {
        "same": lambda: _same(fd, rank, half, same_out),
        "reshard": lambda: _reshard(fd, rank, size, reshard_out, cols),
        "tiled_same": lambda: _tiled_same(
            fd, rank, half, same_out.view(np.float32).reshape(-1, cols), cols
        ),
        "tiled_reshard": lambda: _tiled_reshard(fd, rank, half, reshard_out, cols),
    }
    times: dict[str, list[float]] = {case: [] for case in CASES}
    for i in range(rounds + 1):  # the first round warms up
        for case in CASES if i % 2 else CASES[::-1]:
            barrier.wait()
            t0 = time.perf_counter()
            run[case]()
            if i:
                times[case].append(time.perf_counter() - t0)
    q.put((rank, times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=384, help="matrix size in MiB")
    parser.add_argument("--cols", type=int, default=768, help="float32 columns (even)")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    block = 2 * _tile_rows(args.cols) * args.cols * 4  # whole blocks of tiles in each half
    size = args.mib * MIB // (2 * block) * (2 * block)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "matrix")
        np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32).tofile(path)
        ctx = mp.get_context("fork")
        barrier, q = ctx.Barrier(2), ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(r, path, size, args.cols, args.rounds, barrier, q))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        results = sorted(q.get() for _ in procs)
        for p in procs:
            p.join()
    out: dict[str, Any] = {"mib": size // MIB, "cols": args.cols}
    for rank, times in results:
        median = {case: statistics.median(times[case]) for case in CASES}
        out[f"rank{rank}"] = {f"{case}_s": median[case] for case in CASES} | {
            f"{case}_vs_same": median[case] / median["same"] for case in CASES[1:]
        }
    for case in CASES[1:]:
        out[f"{case}_vs_same"] = max(r[f"{case}_vs_same"] for k, r in out.items() if "rank" in k)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
