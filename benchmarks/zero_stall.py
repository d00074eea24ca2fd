"""The training stall of a zero-stall save: how much longer an iteration with a save takes.

Builds the benchmark's GPT with AdamW, sharded with FSDP2 over ``--world`` CPU processes (gloo),
and alternates, ``--rounds`` times, a plain iteration (forward, backward, step) and one that
starts with ``async_save(..., zero_stall=True)``; each save is waited for before the
next round, outside the timing. The extra time of a round is its save iteration minus its plain
iteration, the slowest rank counting (ranks step together). Prints medians over the rounds, and
the CPU time a save costs a rank (all its threads, from the call until the save is committed,
less a plain iteration's), which a busy machine disturbs less than wall time.

python benchmarks/zero_stall.py --params 20M --world 2 --rounds 15
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import unickpt
from unickpt.bench.config import parse_param_count
from unickpt.bench.model import build_train_state, config_for_params
from unickpt.bench.stall import plain_iteration_s, slowest, stall_s


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, args.threads))
    state = build_train_state(config_for_params(parse_param_count(args.params)), "shard0", 256)
    rows = []
    for r in range(args.warmup + args.rounds):
        c0 = time.process_time()
        plain = plain_iteration_s(state)
        plain_cpu = time.process_time() - c0
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        fut = unickpt.async_save(
            f"{args.workdir}/r{r}", state.state(), zero_stall=True, overwrite=True
        )
        call = time.perf_counter() - t0
        state.forward_backward()
        t1 = time.perf_counter()
        state.step()
        t2 = time.perf_counter()
        extra = stall_s(plain, t2 - t0)
        fut.wait()
        save_cpu = time.process_time() - c0 - plain_cpu  # every thread of the rank
        step_wait = max(0.0, fut.blocking_s - call)
        if r >= args.warmup:
            row = (call, step_wait, t2 - t1, save_cpu)
            rows.append((plain, plain + extra, *(slowest(x) for x in row)))
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="20M")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--workdir", default=None, help="checkpoint folder (default: a temp one)")
    args = parser.parse_args(argv)
    own = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="unickpt-zero-stall-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world, port, args, q)) for r in range(args.world)
    ]
    for p in procs:
        p.start()
    rows = q.get(timeout=3600)
    for p in procs:
        p.join()
    if own:
        shutil.rmtree(args.workdir, ignore_errors=True)
    med = {
        name: statistics.median(row[i] for row in rows)
        for i, name in enumerate(
            ("plain_s", "with_save_s", "call_s", "step_wait_s", "step_s", "save_cpu_s")
        )
    }
    med["extra_s"] = statistics.median(saving - plain for plain, saving, *_ in rows)
    extras = [round(saving - plain, 4) for plain, saving, *_ in rows]
    out = {"params": args.params, "world": args.world, "rounds": len(rows), "median": med}
    out["extra_s_per_round"] = extras
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
