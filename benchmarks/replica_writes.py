"""Save time of one large tensor held whole by every rank, written whole or in shares.

Every one of ``n`` ranks (1 to 4, gloo on loopback) holds the same float32 tensor of ``--mib``
MiB and saves it durably (``unickpt.save``: fsync and commit included), alternately with
``replica_share_bytes=0`` (the box written whole by one rank, as before replica-parallel writes)
and with ``--share-mib`` (each of the ``n`` holders writes a share). Reports, per ``n``, the
median over ``--repeats`` saves of the save time at the slowest rank and the largest share of
the bytes one rank wrote; ``--mib`` takes several sizes (the threshold's sweep).

python benchmarks/replica_writes.py --mib 256 --replicas 1,2,3,4 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from _ranks import run_world

import unickpt
from unickpt.bench.stall import slowest

MiB = 1 << 20


def _rank(rank: int, world: int, args: argparse.Namespace, q: Any) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out: dict[str, dict[str, float]] = {}
    for mib in args.mib:
        rows = mib * MiB // (4 * 1024)
        state = {"w": torch.randn(rows, 1024, generator=torch.Generator().manual_seed(0))}
        modes = {"whole": 0, "shares": args.share_mib * MiB}
        times: dict[str, list[float]] = {m: [] for m in modes}
        largest: dict[str, float] = {}
        for r in range(args.warmup + args.repeats):
            for mode, share in modes.items():
                config = unickpt.get_config(replica_share_bytes=share)
                path = f"{args.workdir}/{mode}-{r}"
                dist.barrier()
                t0 = time.perf_counter()
                report = unickpt.save(path, state, overwrite=True, config=config)
                took = slowest(time.perf_counter() - t0)
                written = torch.tensor(float(report.bytes_written))
                dist.all_reduce(written, op=dist.ReduceOp.MAX)
                largest[mode] = float(written) / (rows * 1024 * 4)
                if r >= args.warmup:
                    times[mode].append(took)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
        for mode in modes:
            out[f"{mib}.{mode}"] = {
                "save_s": round(statistics.median(times[mode]), 4),
                "largest_file_fraction": round(largest[mode], 3),
            }
    if rank == 0:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="256", help="tensor sizes in MiB, comma-separated")
    parser.add_argument("--replicas", default="1,2,3,4")
    parser.add_argument("--share-mib", type=int, default=16, help="replica_share_bytes in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--workdir", default=None, help="checkpoint folder (default: a temp one)")
    args = parser.parse_args(argv)
    args.mib = [int(x) for x in args.mib.split(",")]
    own = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="unickpt-replicas-", dir="/var/tmp")
    results: dict[str, Any] = {}
    for n in (int(x) for x in args.replicas.split(",")):
        results[str(n)] = run_world(n, _rank, args)
    if own:
        shutil.rmtree(args.workdir, ignore_errors=True)
    report = {"share_mib": args.share_mib, "repeats": args.repeats, "replicas": results}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
