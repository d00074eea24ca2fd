"""Goodput under failures: storage checkpoints at their best interval vs the memory tier.

A small MLP with Adam trains ``--steps`` steps on two ranks that act as two nodes
(``UNICKPT_NODE``), while the driver kills the whole job (SIGKILL, every rank) after a random
time drawn with mean ``--mtbf`` seconds (counted once the job has restored its state), and
restarts it, until the steps are done. Every other failure also wipes node b's memory folder
(a node lost with its memory). Two policies:

(a) storage: an asynchronous checkpoint to ``--storage`` every K steps, K from Young's formula
    sqrt(2 * stall * MTBF) with the stall measured in a calibration run;
(b) memory: ``MemoryTier(replicas=2)`` saves every step, persisting every ``--persist-s``
    seconds' worth of steps.

Goodput is useful training time (steps x the measured time of a plain step) over wall time;
work lost is the steps trained past the checkpoint a restart resumes from; restore is the time
from a job's start until its state holds the values. Then a model scales the measured costs to
1,024 GPUs with one failure an hour (assumptions printed with it).

python benchmarks/goodput.py --steps 600 --mtbf 20 --persist-s 20
python benchmarks/goodput.py --minutes 2 --mtbf 15 --persist-s 10   # a short run
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import unickpt


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 1024, generator=g)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
    opt.step()


def _rank(rank: int, world: int, port: int, a: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["UNICKPT_NODE"] = f"node-{rank}"
    t_start = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt = _model()
    state = {"model": model, "optim": opt, "step": 0}
    memory = None
    if a["mode"] == "memory":
        memory = unickpt.MemoryTier(
            persist_every=a["persist_every"], replicas=2, dir=a["dirs"][rank]
        )
    ckpt = unickpt.Checkpointer(a["root"], keep_last=2, memory=memory)
    last = ckpt.load_latest(state)
    restore_s = time.perf_counter() - t_start
    source = ckpt.last_restore.source if ckpt.last_restore else ("storage" if last else "none")
    log = open(a["log"], "a") if rank == 0 else None  # noqa: SIM115 - appended to per step
    if log:
        log.write(json.dumps({"start": last, "restore_s": restore_s, "source": source}) + "\n")
        log.flush()
    first = 0 if last is None else last + 1
    stalls, steps = [], []
    for step in range(first, a["steps"]):
        t0 = time.perf_counter()
        _train_step(model, opt, step)
        steps.append(time.perf_counter() - t0)
        state["step"] = step
        if a["mode"] == "memory" or (a["mode"] == "storage" and step % a["every"] == 0):
            t0 = time.perf_counter()
            ckpt.save(step, state)
            stalls.append(time.perf_counter() - t0)
        if log:
            log.write(json.dumps({"step": step}) + "\n")
            log.flush()
    ckpt.close()
    if log:
        stall = statistics.median(stalls) if stalls else 0.0
        done = {"done": True, "stall": stall, "step_s": statistics.median(steps)}
        log.write(json.dumps(done) + "\n")
    dist.destroy_process_group()


def _job(a: dict[str, Any]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.start_processes(_rank, args=(2, port, a), nprocs=2, start_method="spawn")


def _calibrate(a: dict[str, Any]) -> dict[str, float]:
    """Plain step time, and the stall of a storage and of a memory save (median, seconds)."""
    out = {}
    for mode, every in (("none", 10**9), ("storage", 1), ("memory", 1)):
        root = tempfile.mkdtemp(prefix="goodput-cal-", dir=a["storage"])
        log = Path(root) / "log"
        dirs = [f"{root}/mem-{r}" for r in (0, 1)]
        job = {**a, "mode": mode, "every": every, "persist_every": 10**9, "root": root}
        job.update(steps=20, log=str(log), dirs=dirs)
        try:
            subprocess.run([sys.executable, __file__, "--job", json.dumps(job)], check=True)
            last = json.loads(log.read_text().splitlines()[-1])
        finally:
            shutil.rmtree(root, ignore_errors=True)
        out[mode] = last["stall"]
        out[f"{mode}_step"] = last["step_s"]
    return out


def _wait_started(log: Path, starts: int, proc: subprocess.Popen[bytes]) -> None:
    """Until the job's ``starts``-th start is logged (its state restored) or it ended."""
    while proc.poll() is None:
        if log.exists() and log.read_text().count('"start"') >= starts:
            return
        time.sleep(0.1)


def _run(policy: str, a: dict[str, Any], cal: dict[str, float], rng: random.Random) -> dict:
    root = tempfile.mkdtemp(prefix=f"goodput-{policy}-", dir=a["storage"])
    shm = Path(tempfile.mkdtemp(prefix=f"goodput-{policy}-", dir="/dev/shm"))
    log = Path(root) / "log"
    job = {**a, "mode": policy, "root": root, "log": str(log)}
    job["dirs"] = [str(shm / f"node-{r}") for r in (0, 1)]
    job["every"] = a["every"]
    job["persist_every"] = a["persist_every"]
    failures, t0 = [], time.perf_counter()
    try:
        while True:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--job", json.dumps(job)], start_new_session=True
            )
            _wait_started(log, len(failures) + 1, proc)  # failures strike while training
            wait = rng.expovariate(1 / a["mtbf"])
            try:
                if proc.wait(timeout=wait) != 0:
                    raise RuntimeError(f"the {policy} job failed")
                break
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                node = len(failures) % 2 == 1
                if node:
                    shutil.rmtree(job["dirs"][1], ignore_errors=True)
                failures.append({"node": node})
        wall = time.perf_counter() - t0
        lines = [json.loads(x) for x in log.read_text().splitlines()]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    starts = [i for i, x in enumerate(lines) if "start" in x]
    lost, restores = [], []
    for prev, nxt in itertools.pairwise(starts):
        done = [x["step"] for x in lines[prev:nxt] if "step" in x]
        resumed = lines[nxt]["start"]
        lost.append((done[-1] if done else -1) - (-1 if resumed is None else resumed))
        restores.append((lines[nxt]["restore_s"], lines[nxt]["source"]))
    useful = a["steps"] * cal["step"]
    return {
        "policy": policy,
        "wall_s": wall,
        "goodput": useful / wall,
        "failures": len(failures),
        "lost_steps": lost,
        "restores": restores,
    }


def scale_model(cal: dict[str, float], a: dict[str, Any]) -> list[str]:
    """Goodput at 1,024 GPUs, one failure an hour, from the measured per-rank costs."""
    m = 3600.0  # mean time between failures of the job, seconds
    step = a["scale_step_s"]
    restart = a["scale_restart_s"]
    per_gpu = a["scale_gib_per_gpu"] * 2**30
    measured = a["state_bytes"]
    stall_s = cal["storage"] * per_gpu / measured  # snapshot stall, per byte measured
    write_s = 1024 * per_gpu / (a["scale_storage_gbs"] * 1e9)  # shared storage bandwidth
    mem_stall = cal["memory"] * per_gpu / measured
    # (a) Young's interval, but no shorter than a write to the shared storage takes
    interval = max(math.sqrt(2 * stall_s * m), write_s)
    read_s = write_s
    lost_a = interval / 2 + read_s + restart
    good_a = (1 - stall_s / interval) * (1 - lost_a / m)
    # (b) memory every step: half a step lost, restore from local or peer memory at copy speed
    restore_b = a["scale_restore_gbs_inv"] * per_gpu / 1e9
    lost_b = step / 2 + restore_b + restart
    good_b = (1 - mem_stall / step) * (1 - lost_b / m)
    return [
        f"| (a) storage every {interval:.0f} s | {stall_s * 1e3:.0f} ms | "
        f"{lost_a:.0f} s | {good_a:.4f} |",
        f"| (b) memory every step ({step:.1f} s) | {mem_stall * 1e3:.0f} ms | "
        f"{lost_b:.1f} s | {good_b:.4f} |",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="instead of --steps: each policy's failure-"
        "free training time, in minutes (steps from the calibrated step time)",
    )
    p.add_argument("--mtbf", type=float, default=20.0, help="mean seconds between failures")
    p.add_argument("--persist-s", type=float, default=20.0, help="memory tier: persist period")
    p.add_argument("--storage", default=tempfile.gettempdir(), help="where storage saves go")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.job:
        _job(json.loads(args.job))
        return
    a: dict[str, Any] = {"steps": args.steps, "storage": args.storage, "mtbf": args.mtbf}
    cal = _calibrate(a)
    cal["step"] = cal["none_step"]
    if args.minutes is not None:
        a["steps"] = max(20, round(args.minutes * 60 / cal["step"]))
    model, _ = _model()
    a["state_bytes"] = 3 * sum(p.numel() * 4 for p in model.parameters())  # weights + Adam
    a["every"] = max(1, round(math.sqrt(2 * cal["storage"] * args.mtbf) / cal["step"]))
    a["persist_every"] = max(1, round(args.persist_s / cal["step"]))
    rng = random.Random(args.seed)
    runs = [_run(policy, a, cal, rng) for policy in ("storage", "memory")]
    print(f"step {cal['step'] * 1e3:.0f} ms (measured); storage every {a['every']} steps; ")
    print(f"memory tier every step, persisting every {a['persist_every']} steps")
    print("| policy | failures | goodput | work lost per failure (steps) | restore per failure |")
    print("| --- | --- | --- | --- | --- |")
    for r in runs:
        lost = statistics.mean(r["lost_steps"]) if r["lost_steps"] else 0.0
        rest = ", ".join(f"{s:.1f} s {src}" for s, src in r["restores"]) or "-"
        print(f"| {r['policy']} | {r['failures']} | {r['goodput']:.2f} | {lost:.1f} | {rest} |")
    a.update(scale_step_s=1.0, scale_restart_s=60.0, scale_gib_per_gpu=2.0)
    a.update(scale_storage_gbs=50.0, scale_restore_gbs_inv=1 / 5.0)
    print("\n1,024 GPUs, one failure an hour; 2 GiB of state per GPU, 1 s steps, 60 s restart,")
    print("50 GB/s shared storage, 5 GB/s memory/peer restore per GPU; stalls scaled from here:")
    print("| policy | stall per save | lost per failure | goodput |")
    print("| --- | --- | --- | --- |")
    for line in scale_model(cal, a):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"calibration": cal, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
