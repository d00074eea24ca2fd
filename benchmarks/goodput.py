"""Goodput under failures: storage checkpoints at their best interval vs the memory tier.

A small MLP with Adam trains ``--steps`` steps on two ranks that act as two nodes
(``UNICKPT_NODE``), while the driver kills the whole job (SIGKILL, every rank) after a random
time drawn with mean ``--mtbf`` seconds (counted once the job has restored its state), and
restarts it, until the steps are done; both policies see the same failure times (``--seed``).
Every other failure also wipes node b's memory folder
(a node lost with its memory; the storage files are dropped from the page cache then, so a
restore from storage reads the disk). Two policies:

(a) storage: an asynchronous checkpoint to ``--storage`` every K steps, K from Young's formula
    sqrt(2 * stall * MTBF) with the stall measured in a calibration run;
(b) memory: ``MemoryTier(replicas=2)`` saves every step, persisting every ``--persist-s``
    seconds' worth of steps;
(c) in place: (b) under ``unickpt run`` (a launcher per node, ``--spares`` spares on each):
    a failure kills rank 1's process only (a node lost: every process of its node, and its
    memory folder), and rank 0 recovers in its process with a spare in rank 1's place
    (``unickpt.recover``, the job of benchmarks/recovery.py); without a spare the launchers
    restart every process.

Goodput is useful training time (steps x the measured time of a plain step) over wall time;
work lost is the steps trained past the checkpoint a restart resumes from (counted from the
newest step any earlier job finished); restart is the time from the kill until the new job
trains again (process start, imports, process group, model, restore); restore is the part of
it in ``load_latest``, until the state holds the values, with where each rank's state came
from. ``--batch`` sets a step's compute against the state's 48 MiB. Then a model scales the
measured costs to 1,024 GPUs with one failure an hour (assumptions printed with it); its
restart of a job in place is the 60 s of a cold restart times the ratio measured here between
(c)'s and (b)'s restarts.

python benchmarks/goodput.py --minutes 1 --mtbf 20 --persist-s 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
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


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, batch: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, 1024, generator=g)
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
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt = _model()
    state: dict[str, Any] = {"model": model, "optim": opt, "step": 0}
    if a.get("extra_mib"):  # calibration only: a larger state, the same step
        state["extra"] = torch.ones(a["extra_mib"] << 18)
    memory = None
    if a["mode"] == "memory":
        memory = unickpt.MemoryTier(
            persist_every=a["persist_every"], replicas=2, dir=a["dirs"][rank]
        )
    ckpt = unickpt.Checkpointer(a["root"], keep_last=2, memory=memory)
    t0 = time.perf_counter()
    last = ckpt.load_latest(state)
    restore_s = time.perf_counter() - t0  # until the state holds the values
    source = ckpt.last_restore.source if ckpt.last_restore else ("storage" if last else "none")
    sources: list[Any] = [None] * world
    dist.all_gather_object(sources, source)
    log = open(a["log"], "a") if rank == 0 else None  # noqa: SIM115 - appended to per step
    if log:
        start = {"start": last, "restore_s": restore_s, "sources": sources, "at": time.time()}
        log.write(json.dumps(start) + "\n")
        log.flush()
    first = 0 if last is None else last + 1
    stalls, steps = [], []
    for step in range(first, a["steps"]):
        t0 = time.perf_counter()
        _train_step(model, opt, step, a["batch"])
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
        done = {"done": True, "stall": stall, "step_s": statistics.median(steps) if steps else 0.0}
        log.write(json.dumps(done) + "\n")
    dist.destroy_process_group()


def _job(a: dict[str, Any]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.start_processes(_rank, args=(2, port, a), nprocs=2, start_method="spawn")


EXTRA_MIB = 192  # the calibration's second state size: the training state plus this


def _calibrate(a: dict[str, Any]) -> dict[str, float]:
    """Plain step time, and the stall of a storage and of a memory save (median, seconds),
    for the training state and for it plus ``EXTRA_MIB`` (``<mode>_big``), so that the
    stall's fixed part and its cost per byte can be told apart."""
    out = {}
    runs = [("none", 10**9, 0), ("storage", 1, 0), ("memory", 1, 0)]
    runs += [("storage", 1, EXTRA_MIB), ("memory", 1, EXTRA_MIB)]
    for mode, every, extra in runs:
        root = tempfile.mkdtemp(prefix="goodput-cal-", dir=a["storage"])
        shm = tempfile.mkdtemp(prefix="goodput-cal-", dir="/dev/shm")
        log = Path(root) / "log"
        dirs = [f"{shm}/node-{r}" for r in (0, 1)]
        job = {**a, "mode": mode, "every": every, "persist_every": 10**9, "root": root}
        job.update(steps=20, log=str(log), dirs=dirs, extra_mib=extra)
        try:
            subprocess.run([sys.executable, __file__, "--job", json.dumps(job)], check=True)
            last = json.loads(log.read_text().splitlines()[-1])
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
        name = mode if extra == 0 else f"{mode}_big"
        out[name] = last["stall"]
        out[f"{name}_step"] = last["step_s"]
    return out


def _evict(root: Path) -> None:
    """Drop the storage files under ``root`` from the page cache (a lost node's cache is gone;
    shared storage is read from the far side), so a restore from storage reads the disk."""
    for path in root.rglob("*"):
        if path.is_file():
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # a retired step, removed by a dying rank
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


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
                if node:  # a node lost: its memory, and what its page cache held
                    shutil.rmtree(job["dirs"][1], ignore_errors=True)
                    _evict(Path(root))
                failures.append({"node": node, "killed_at": time.time()})
        wall = time.perf_counter() - t0
        lines = [json.loads(x) for x in log.read_text().splitlines()]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    lost, restores = lost_work(lines)
    starts = [x for x in lines if "start" in x][1:]
    restarts = [s["at"] - f["killed_at"] for s, f in zip(starts, failures)]
    useful = a["steps"] * cal["step"]
    return {
        "policy": policy,
        "wall_s": wall,
        "goodput": useful / wall,
        "failures": len(failures),
        "lost_steps": lost,
        "restores": restores,
        "restarts_s": restarts,
    }


def _run_inplace(a: dict[str, Any], cal: dict[str, float], rng: random.Random) -> dict:
    """Policy (c): the job of benchmarks/recovery.py under ``unickpt run`` with spares; each
    failure kills rank 1's process, every other one every process of its node (and its memory
    folder)."""
    import recovery

    base = Path(tempfile.mkdtemp(prefix="goodput-inplace-", dir=a["storage"]))
    shm = Path(tempfile.mkdtemp(prefix="goodput-inplace-", dir="/dev/shm"))
    log = base / "log"
    cfg = {"root": str(base / "root"), "out": str(base / "out"), "steps": a["steps"]}
    cfg.update(batch=a["batch"], dirs=[str(shm / "a"), str(shm / "b")], goodput_log=str(log))
    cfg["persist_every"] = a["persist_every"]
    failures: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    job = recovery.Job(cfg, (a["spares"], a["spares"]), max_restarts=100)
    try:
        while True:
            starts = len(failures) + 1  # failures strike while training
            job.wait(
                "a start", lambda n=starts: log.exists() and log.read_text().count('"start"') >= n
            )
            deadline = time.monotonic() + rng.expovariate(1 / a["mtbf"])
            while time.monotonic() < deadline and all(p.poll() is None for p in job.launchers):
                time.sleep(0.05)
            if any(p.poll() is not None for p in job.launchers):
                codes = [p.wait() for p in job.launchers]
                if codes != [0, 0]:
                    raise RuntimeError(f"the in-place job failed: launchers exited {codes}")
                break
            node = len(failures) % 2 == 1
            victim = job.current(1)
            if node:  # a node lost: every process on it, its memory, its page cache
                name = _node_of(job, victim["pid"])
                for pid in _processes_of(job, name):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                shutil.rmtree(cfg["dirs"]["ab".index(name)], ignore_errors=True)
                _evict(Path(cfg["root"]))
            else:
                os.kill(victim["pid"], signal.SIGKILL)
            failures.append({"node": node, "killed_at": time.time()})
        wall = time.perf_counter() - t0
        lines = [json.loads(x) for x in log.read_text().splitlines()]
    finally:
        job.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    lost, restores = lost_work(lines)
    starts = [x for x in lines if "start" in x][1:]
    return {
        "policy": "in place",
        "wall_s": wall,
        "goodput": a["steps"] * cal["step"] / wall,
        "failures": len(failures),
        "lost_steps": lost,
        "restores": restores,
        "restarts_s": [s["at"] - f["killed_at"] for s, f in zip(starts, failures)],
    }


def _started(job: Any) -> list[tuple[str, int]]:
    """(node, pid) of every process the job's launchers started."""
    found = []
    for name in "ab":
        text = (job.out / f"launcher-{name}.log").read_text()
        found += [
            (name, int(pid)) for pid in re.findall(r"started slot \S+ \(.*\), pid (\d+)", text)
        ]
    return found


def _node_of(job: Any, pid: int) -> str:
    return next(name for name, p in _started(job) if p == pid)


def _processes_of(job: Any, node: str) -> list[int]:
    """The live processes of ``node``'s launcher (children of it: a pid is never reused for
    another process while the launcher has not reaped it)."""
    launcher = job.launchers["ab".index(node)].pid
    return [p for name, p in _started(job) if name == node and _parent(p) == launcher]


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def _run_row(r: dict[str, Any], step_s: float) -> str:
    lost = statistics.mean(r["lost_steps"]) if r["lost_steps"] else 0.0
    rest = _spread([t for t, _ in r["restores"]])
    sources = {src: sum(1 for _, s in r["restores"] if s == src) for _, src in r["restores"]}
    where = ", ".join(f"{src} {n}" for src, n in sources.items()) or "-"
    return (
        f"| {r['policy']} | {r['failures']} | {r['wall_s']:.0f} s | {r['goodput']:.2f} | "
        f"{lost:.1f} steps ({lost * step_s:.1f} s) | {_spread(r['restarts_s'])} | {rest} | "
        f"{where} |"
    )


def lost_work(lines: list[dict[str, Any]]) -> tuple[list[int], list[tuple[float, str]]]:
    """Per restart: the steps trained past the step it resumed from, and its restore.

    A job may be killed before it trains a step; the progress it had then is the newest step
    any earlier job finished, so the steps lost are counted from the high-water mark, never
    from the job just before.
    """
    lost, restores = [], []
    done = -1  # the newest step finished so far, over every earlier job
    starts = 0
    for x in lines:
        if "step" in x:
            done = max(done, x["step"])
        elif "start" in x:
            starts += 1
            if starts > 1:  # the first start is the job's beginning, not a restart
                lost.append(done - (-1 if x["start"] is None else x["start"]))
                restores.append((x["restore_s"], "+".join(sorted(set(x["sources"])))))
    return lost, restores


def _policy_row(name: str, interval: float, stall: float, restore: float, a: dict) -> str:
    """Goodput of saving after every ``interval`` s of training at a cost of ``stall`` s.

    Each period is ``interval`` of work plus the stall; a failure loses half a period on
    average plus the restore and the restart: goodput = interval / (interval + stall) x
    (1 - lost / MTBF).
    """
    period = interval + stall
    lost = period / 2 + restore + a["scale_restart_s"]
    good = interval / period * (1 - lost / a["scale_mtbf_s"])
    return f"| {name} | {interval:.0f} s | {stall * 1e3:.0f} ms | {lost:.1f} s | {good:.4f} |"


def _stall_at(cal: dict[str, float], mode: str, nbytes: float, a: dict[str, Any]) -> float:
    """A save's stall for ``nbytes`` per rank: fixed part plus cost per byte, from the two
    calibration sizes (each rank saves half of the replicated state)."""
    small = a["state_bytes"] / 2
    big = small + (EXTRA_MIB << 20) / 2
    per_byte = max(0.0, (cal[f"{mode}_big"] - cal[mode]) / (big - small))
    fixed = max(0.0, cal[mode] - per_byte * small)
    return fixed + per_byte * nbytes


# The stall of a zero-stall save on a GPU: its snapshot copies device to host. On an H100 the
# asynchronous save of 12.3 GB (1B parameters with Adam) held the next iteration 0.343 s
# (docs/benchmarks.md, "GPU (NVIDIA H100 80GB HBM3)"): 0.028 s per GB.
GPU_STALL_S_PER_GB = 0.343 / 12.302


def scale_model(cal: dict[str, float], a: dict[str, Any], inplace_ratio: float) -> list[str]:
    """Goodput at 1,024 GPUs, one failure an hour, from the measured per-rank costs; a restart
    in place costs ``inplace_ratio`` of a cold one."""
    m = a["scale_mtbf_s"]
    step = a["scale_step_s"]
    per_gpu = a["scale_gib_per_gpu"] * 2**30
    stall_s = _stall_at(cal, "storage", per_gpu, a)
    mem_stall = _stall_at(cal, "memory", per_gpu, a)
    gpu_stall = GPU_STALL_S_PER_GB * per_gpu / 1e9
    write_s = 1024 * per_gpu / (a["scale_storage_gbs"] * 1e9)  # shared storage bandwidth
    restore_mem = per_gpu / (a["scale_restore_gbs"] * 1e9)
    in_place = {**a, "scale_restart_s": a["scale_restart_s"] * inplace_ratio}
    # (a) Young's interval, no shorter than a write of every GPU's state to shared storage
    interval_a = max(math.sqrt(2 * stall_s * m), write_s)
    # (b) memory every step; (b') the memory tier at Young's interval for its own stall
    interval_b = max(math.sqrt(2 * mem_stall * m), step)
    interval_g = max(math.sqrt(2 * gpu_stall * m), step)
    return [
        _policy_row("(a) storage, Young's interval", interval_a, stall_s, write_s, a),
        _policy_row("(b) memory tier every step", step, mem_stall, restore_mem, a),
        _policy_row("(b') memory tier, Young's interval", interval_b, mem_stall, restore_mem, a),
        _policy_row(
            "(c) memory tier in place, Young's interval",
            interval_b,
            mem_stall,
            restore_mem,
            in_place,
        ),
        _policy_row(
            "(b'') memory tier, GPU stall, Young's interval", interval_g, gpu_stall, restore_mem, a
        ),
        _policy_row(
            "(c') memory tier in place, GPU stall, Young's interval",
            interval_g,
            gpu_stall,
            restore_mem,
            in_place,
        ),
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
    p.add_argument(
        "--batch",
        type=int,
        default=256,
        help="rows per step: sets the step's compute against the state's 48 MiB",
    )
    p.add_argument("--spares", type=int, default=3, help="in place: spares on each node")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.job:
        _job(json.loads(args.job))
        return
    a: dict[str, Any] = {"steps": args.steps, "storage": args.storage, "mtbf": args.mtbf}
    a["batch"] = args.batch
    cal = _calibrate(a)
    cal["step"] = cal["none_step"]
    if args.minutes is not None:
        a["steps"] = max(20, round(args.minutes * 60 / cal["step"]))
    model, _ = _model()
    a["state_bytes"] = 3 * sum(p.numel() * 4 for p in model.parameters())  # weights + Adam
    a["every"] = max(1, round(math.sqrt(2 * cal["storage"] * args.mtbf) / cal["step"]))
    a["persist_every"] = max(1, round(args.persist_s / cal["step"]))
    # the same failure times for both policies: each draws from a generator seeded alike
    runs = [_run(policy, a, cal, random.Random(args.seed)) for policy in ("storage", "memory")]
    a["spares"] = args.spares
    runs.append(_run_inplace(a, cal, random.Random(args.seed)))
    cold = statistics.median(runs[1]["restarts_s"]) if runs[1]["restarts_s"] else float("nan")
    warm = statistics.median(runs[2]["restarts_s"]) if runs[2]["restarts_s"] else float("nan")
    ratio = warm / cold
    print(
        f"step {cal['step'] * 1e3:.0f} ms, save stall: storage {cal['storage'] * 1e3:.0f} ms, "
        f"memory tier {cal['memory'] * 1e3:.0f} ms (medians, measured); "
        f"{a['steps']} steps; storage every {a['every']} steps; memory tier every step, "
        f"persisting every {a['persist_every']} steps"
    )
    print(
        "| policy | failures | wall | goodput | work lost per failure (mean) | restart: kill "
        "to training again | of which restore | restored from (ranks' sources) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        print(_run_row(r, cal["step"]))
    a.update(scale_step_s=1.0, scale_restart_s=60.0, scale_gib_per_gpu=2.0, scale_mtbf_s=3600.0)
    a.update(scale_storage_gbs=50.0, scale_restore_gbs=5.0)
    print("\n1,024 GPUs, one failure an hour; 2 GiB of state per GPU, 1 s steps, 60 s restart,")
    print("50 GB/s shared storage, 5 GB/s memory/peer restore per GPU; stalls from the fixed")
    print(
        f"part and cost per byte measured here (state and state + {EXTRA_MIB} MiB: storage "
        f"{cal['storage'] * 1e3:.0f}/{cal['storage_big'] * 1e3:.0f} ms, memory tier "
        f"{cal['memory'] * 1e3:.0f}/{cal['memory_big'] * 1e3:.0f} ms):"
    )
    print(
        f"in place: a restart costs {ratio:.2f}x a cold one (median restart here: in place "
        f"{warm:.2f} s, memory tier {cold:.2f} s), so {a['scale_restart_s'] * ratio:.0f} s at "
        f"scale; GPU stall {GPU_STALL_S_PER_GB * a['scale_gib_per_gpu'] * 2**30 / 1e9 * 1e3:.0f} "
        "ms (an H100's device-to-host snapshot, docs/benchmarks.md):"
    )
    print("| policy | interval | stall per save | lost per failure | goodput |")
    print("| --- | --- | --- | --- | --- |")
    for line in scale_model(cal, a, ratio):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"calibration": cal, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
