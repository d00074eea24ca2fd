"""Synchronous save and load of one process's state to a path or URL: medians of wall and CPU
time, to compare storage backends or two versions of the write path.

python benchmarks/storage_throughput.py /tmp/unickpt-bench --repeat 7
python benchmarks/storage_throughput.py memory://bench --small 20000
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch

import unickpt

MiB = 1 << 20


def build_state(big: int, small: int) -> dict[str, torch.Tensor]:
    """``big`` tensors of 64 MiB, eight of 12 MiB, ``small`` of a few KiB (float32)."""
    g = torch.Generator().manual_seed(0)
    state = {f"big{i}": torch.randn(16 * MiB, generator=g) for i in range(big)}
    state.update({f"mid{i}": torch.randn(3 * MiB, generator=g) for i in range(8)})
    state.update({f"small{i}": torch.randn(1000 + i % 1000, generator=g) for i in range(small)})
    return state


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, all threads) of ``fn()``."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    return t1 - t0, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("location", help="checkpoint path or URL (replaced on every save)")
    parser.add_argument("--repeat", type=int, default=5, help="saves and loads measured")
    parser.add_argument("--big", type=int, default=14, help="64 MiB tensors (default 14)")
    parser.add_argument("--small", type=int, default=2000, help="small tensors (default 2000)")
    args = parser.parse_args(argv)
    state = build_state(args.big, args.small)
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    saves, loads = [], []
    for _ in range(args.repeat):
        saves.append(timed(lambda: unickpt.save(args.location, state, overwrite=True)))
        loads.append(timed(lambda: unickpt.load(args.location, dest)))
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    print(f"{nbytes / MiB:,.0f} MiB, {len(state)} tensors, {args.location}, {args.repeat} runs")
    for name, runs in (("save", saves), ("load", loads)):
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        rate = nbytes / MiB / wall
        print(f"{name} (median): {wall:.3f} s wall ({rate:,.0f} MiB/s), {cpu:.3f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
