"""Resharded load against same-layout load: time and bytes read, checksums verified.

Saves transformer-shaped matrices as ``Shard(0)`` over ``--world`` CPU ranks (gloo), then loads
them, alternating, into ``Shard(0)`` (the same layout), into ``Shard(1)`` with reads shared on the
host, and into ``Shard(1)`` with every rank reading alone (``share_reads=False``). Times are the
slowest rank's, medians (min, max) of ``--runs`` rounds; CPU times (user and system, all threads)
and bytes are summed over ranks; the garbage collector's runs during the loads are counted per
rank and load. On a machine that others share, CPU time is the steadier
figure: waiting for a core does not count.

python benchmarks/reshard.py --mb 400 --world 2 --runs 5
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import unickpt
from unickpt.config import get_config

CASES = ("same", "reshard", "reshard_alone")


def _shapes(total_bytes: int, d: int = 768) -> dict[str, tuple[int, int]]:
    """Matrices of a GPT block (d x 4d, 4d x d, d x 3d, d x d) until ``total_bytes`` of fp32."""
    per_block = {"fc": (4 * d, d), "proj": (d, 4 * d), "qkv": (3 * d, d), "out": (d, d)}
    shapes: dict[str, tuple[int, int]] = {}
    block = 0
    while sum(4 * a * b for a, b in shapes.values()) < total_bytes:
        for name, shape in per_block.items():
            shapes[f"h{block}.{name}"] = shape
        block += 1
    return shapes


def _state(shapes: dict[str, tuple[int, int]], mesh: Any, dim: int, fill: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for key, shape in shapes.items():
        full = torch.randn(shape, generator=g) if fill else torch.zeros(shape)
        out[key] = distribute_tensor(full, mesh, [Shard(dim)])
    return out


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    shapes = _shapes(args.mb * 2**20)
    path = os.path.join(args.dir, "ckpt")
    unickpt.save(path, _state(shapes, mesh, 0, fill=True))
    dests = {
        "same": _state(shapes, mesh, 0, fill=False),
        "reshard": _state(shapes, mesh, 1, fill=False),
        "reshard_alone": _state(shapes, mesh, 1, fill=False),
    }
    configs = {c: get_config(share_reads=c != "reshard_alone") for c in CASES}
    rows: list[dict[str, Any]] = []
    collections = _Collections()
    for run in range(args.runs + 1):
        for case in CASES if run % 2 else reversed(CASES):
            dist.barrier()
            cpu = _cpu_s()
            collections.reset()
            start = time.perf_counter()
            report = unickpt.load(path, dests[case], config=configs[case])
            elapsed = time.perf_counter() - start
            rows.append(
                dict(run=run, case=case, s=elapsed, cpu=_cpu_s() - cpu, read=report.bytes_read,
                     wanted=report.bytes_wanted, peers=report.bytes_from_peers,
                     gc=collections.count, gc_s=collections.seconds)
            )  # fmt: skip
    reference = _state(shapes, mesh, 1, fill=True)
    got = dests["reshard"]
    equal = all(torch.equal(got[k].to_local(), reference[k].to_local()) for k in shapes)
    q.put((rank, rows, equal))
    dist.destroy_process_group()


class _Collections:
    """The garbage collector's runs (and their seconds) since :meth:`reset`."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t0 = 0, 0.0, 0.0
        gc.callbacks.append(self._callback)

    def reset(self) -> None:
        self.count, self.seconds = 0, 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._t0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu(per_rank: list[list[dict[str, Any]]], run: int, case: str) -> float:
    return sum(r["cpu"] for rows in per_rank for r in rows if (r["run"], r["case"]) == (run, case))


def _slowest(per_rank: list[list[dict[str, Any]]], run: int, case: str) -> float:
    return max(r["s"] for rows in per_rank for r in rows if (r["run"], r["case"]) == (run, case))


def _per_load(per_rank: list[list[dict[str, Any]]], runs: int, case: str, field: str) -> float:
    """``field`` summed over ranks and measured rounds, per rank and load."""
    total = sum(r[field] for rows in per_rank for r in rows if r["case"] == case and r["run"])
    return total / (runs * len(per_rank))


def _summary(per_rank: list[list[dict[str, Any]]], runs: int) -> dict[str, Any]:
    """Slowest rank per (run, case); the first round is a warm-up and is dropped."""
    out: dict[str, Any] = {}
    for case in CASES:
        times, ratios, cpus, cpu_ratios = [], [], [], []
        for run in range(1, runs + 1):
            times.append(_slowest(per_rank, run, case))
            ratios.append(times[-1] / _slowest(per_rank, run, "same"))
            cpus.append(_cpu(per_rank, run, case))
            cpu_ratios.append(cpus[-1] / _cpu(per_rank, run, "same"))
        last = [r for rows in per_rank for r in rows if (r["run"], r["case"]) == (runs, case)]
        out[case] = dict(
            median_s=statistics.median(times), min_s=min(times), max_s=max(times),
            ratio_to_same_median=statistics.median(ratios),
            ratio_min=min(ratios), ratio_max=max(ratios),
            cpu_median_s=statistics.median(cpus),
            cpu_ratio_to_same_median=statistics.median(cpu_ratios),
            bytes_read=sum(r["read"] for r in last), bytes_needed=sum(r["wanted"] for r in last),
            bytes_from_peers=sum(r["peers"] for r in last),
            collections_per_load=_per_load(per_rank, runs, case, "gc"),
            collection_s_per_load=_per_load(per_rank, runs, case, "gc_s"),
        )  # fmt: skip
        out[case]["read_over_needed"] = out[case]["bytes_read"] / out[case]["bytes_needed"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400, help="state size in MiB (fp32)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5, help="measured rounds (after a warm-up)")
    parser.add_argument("--dir", default=None, help="folder for the checkpoint (default: a temp)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(r, args.world, port, args, q))
            for r in range(args.world)
        ]
        for p in procs:
            p.start()
        results = sorted(q.get() for _ in procs)
        for p in procs:
            p.join()
    summary = _summary([rows for _, rows, _ in results], args.runs)
    summary["reshard_values_equal"] = all(eq for _, _, eq in results)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
