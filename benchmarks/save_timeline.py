"""Where a durable save's time goes, per rank, against the raw write of the same bytes.

Builds the benchmark's GPT with AdamW, sharded with FSDP2 over ``--world`` CPU processes (gloo),
and runs, ``--repeats`` times, durable ``unickpt.save`` calls (fsync and commit included)
without and with early writeback (``unickpt.storage.local.EARLY_WRITEBACK``: each part's pages
handed to the disk as soon as written), then the raw probe: every rank writes as many bytes as
it saves, from one buffer of that size, with four threads (``pwrite``), then ``fsync``s, all
ranks at once. Prints, per rank, the medians of the save's timeline (``SaveReport.timeline``:
plan; hash and write summed over the writer threads; the data file's parts, its completion, the
gather and the commit, wall) and of the save and probe times, the slowest rank counting. The
``bench_probe`` is ``unickpt bench``'s own (the best of two writes from a 16 MiB buffer).

python benchmarks/save_timeline.py --params 100M --world 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _ranks import run_world

import unickpt
import unickpt.storage.local as local_storage
from unickpt.bench.config import parse_param_count
from unickpt.bench.hardware import measure_hardware
from unickpt.bench.model import build_train_state, config_for_params
from unickpt.bench.stall import slowest

_THREADS = 4


def _probe(path: str, buffer: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        step = -(-len(buffer) // _THREADS)

        def write(start: int) -> None:
            end, at = min(start + step, len(buffer)), start
            while at < end:
                at += os.pwrite(fd, buffer[at:end], at)

        with ThreadPoolExecutor(_THREADS) as pool:
            list(pool.map(write, range(0, len(buffer), step)))
        os.fsync(fd)
    finally:
        os.close(fd)


def _rank(rank: int, world: int, args: argparse.Namespace, q: Any) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    state = build_train_state(config_for_params(parse_param_count(args.params)), "shard0", 256)
    rows: list[dict[str, float]] = []
    buffer: memoryview | None = None
    for r in range(args.warmup + args.repeats):
        row: dict[str, float] = {}
        for early in (False, True):
            local_storage.EARLY_WRITEBACK = early
            name = "writeback" if early else "plain"
            path = f"{args.workdir}/save-{r}"
            dist.barrier()
            t0 = time.perf_counter()
            report = unickpt.save(path, state.state(), overwrite=True)
            row[f"{name}.save_s"] = slowest(time.perf_counter() - t0)
            row.update({f"{name}.{k}_s": v for k, v in report.timeline.items()})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
        if buffer is None:
            buffer = memoryview(torch.ones(report.bytes_written, dtype=torch.uint8).numpy())
        t0 = time.perf_counter()
        _probe(f"{args.workdir}/probe-{rank}-{r}", buffer)
        row["probe_s"] = slowest(time.perf_counter() - t0)
        row["bytes"] = float(report.bytes_written)
        dist.barrier()
        os.unlink(f"{args.workdir}/probe-{rank}-{r}")
        hw = measure_hardware(Path(args.workdir), report.bytes_written)
        row["bench_probe_s"] = hw.write_fsync_s
        if r >= args.warmup:
            rows.append(row)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        q.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="100M")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--workdir", default=None, help="checkpoint folder (default: a temp one)")
    args = parser.parse_args(argv)
    own = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="unickpt-timeline-", dir="/var/tmp")
    per_rank = run_world(args.world, _rank, args)
    if own:
        shutil.rmtree(args.workdir, ignore_errors=True)
    ranks = []
    for rows in per_rank:
        keys = rows[0].keys()
        ranks.append({k: round(statistics.median(r[k] for r in rows), 4) for k in keys})
    out: dict[str, Any] = {"params": args.params, "world": args.world, "repeats": args.repeats}
    for probe in ("probe_s", "bench_probe_s"):
        for name in ("plain", "writeback"):
            ratio = ranks[0][f"{name}.save_s"] / ranks[0][probe]
            out[f"{name}_over_{probe[:-2]}"] = round(ratio, 3)
    out["per_rank"] = ranks
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
