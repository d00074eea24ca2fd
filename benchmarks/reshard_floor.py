"""The memory traffic a resharded load cannot avoid, against a same-layout load's, on one host.

Two processes (ranks) load a ``--mib`` MiB float32 matrix of 3 KiB rows that lies in the page
cache as two halves, one saved by each rank (``Shard(0)``), with 1 MiB checksum segments:

- **same layout**: each rank reads its own half (``pread`` of 1 MiB segments into place) and
  hashes each segment right after it lands (in cache), as unickpt's plain load does;
- **resharded** (``Shard(1)``): each rank needs half of every row of both halves. From one
  mapping of the file, each rank hashes the segments of its own half (it owns them) and copies
  its half rows out of each right after hashing it, then copies its half rows out of the other
  rank's half, which that rank verifies: each byte hashed once, each byte needed copied once,
  no buffer of its own, as unickpt's resharded load on one host does.

No planning, no threads, no Python between bytes beyond one call per segment: the floor of each
way. Times are per rank, medians of ``--rounds`` rounds, both ranks running at once.

python benchmarks/reshard_floor.py --mib 384 --rounds 9
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
import xxhash

MIB = 1 << 20
COLS = 768  # float32 columns: 3 KiB rows, half rows of 1.5 KiB


def _same(fd: int, rank: int, half: int, out: np.ndarray) -> None:
    view = memoryview(out)
    for off in range(0, half, MIB):
        os.preadv(fd, [view[off : off + MIB]], rank * half + off)
        xxhash.xxh3_64_hexdigest(view[off : off + MIB])


def _reshard(fd: int, rank: int, size: int, out: np.ndarray) -> None:
    rows = size // (COLS * 4)
    half_rows, seg_rows = rows // 2, MIB // (COLS * 4)
    mapped = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    src = np.frombuffer(mapped, dtype=np.float32).reshape(rows, COLS)
    raw = memoryview(mapped)
    cols = slice(0, COLS // 2) if rank == 0 else slice(COLS // 2, COLS)
    mine, theirs = rank * half_rows, (1 - rank) * half_rows
    for r in range(0, half_rows, seg_rows):
        e = min(half_rows, r + seg_rows)
        xxhash.xxh3_64_hexdigest(raw[(mine + r) * COLS * 4 : (mine + e) * COLS * 4])
        np.copyto(out[mine + r : mine + e], src[mine + r : mine + e, cols])
    for r in range(0, half_rows, 16 * seg_rows):
        e = min(half_rows, r + 16 * seg_rows)
        np.copyto(out[theirs + r : theirs + e], src[theirs + r : theirs + e, cols])
    del src, raw
    mapped.close()


def _rank(rank: int, path: str, size: int, rounds: int, barrier: Any, q: Any) -> None:
    fd = os.open(path, os.O_RDONLY)
    same_out = np.zeros(size // 2, dtype=np.uint8)
    reshard_out = np.zeros((size // (COLS * 4), COLS // 2), dtype=np.float32)
    times: dict[str, list[float]] = {"same": [], "reshard": []}
    for i in range(rounds + 1):  # the first round warms up
        for case in ("same", "reshard") if i % 2 else ("reshard", "same"):
            barrier.wait()
            t0 = time.perf_counter()
            if case == "same":
                _same(fd, rank, size // 2, same_out)
            else:
                _reshard(fd, rank, size, reshard_out)
            if i:
                times[case].append(time.perf_counter() - t0)
    q.put((rank, times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=384, help="matrix size in MiB")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    size = args.mib * MIB // (2 * COLS * 4) * (2 * COLS * 4)  # whole rows in each half
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "matrix")
        np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32).tofile(path)
        ctx = mp.get_context("fork")
        barrier, q = ctx.Barrier(2), ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(r, path, size, args.rounds, barrier, q))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        results = sorted(q.get() for _ in procs)
        for p in procs:
            p.join()
    out: dict[str, Any] = {"mib": size // MIB}
    for rank, times in results:
        same, reshard = statistics.median(times["same"]), statistics.median(times["reshard"])
        out[f"rank{rank}"] = dict(same_s=same, reshard_s=reshard, ratio=reshard / same)
    out["ratio"] = max(r["ratio"] for k, r in out.items() if k.startswith("rank"))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
