"""Recovery in place against a cold restart: the time from a kill to the next completed step.

Two nodes on this machine (``unickpt run`` twice: nodes a and b, a memory folder each), one
rank on each training goodput.py's model (4 layers 1024 wide, Adam, 48 MiB of state, ``--batch``
rows a step, gradients summed by all_reduce in a fixed order), a memory-tier save every step
(``replicas=2``). After ``--warm`` steps the driver kills rank 1's process (SIGKILL), and again
``--warm`` steps after each recovery, ``--kills`` times, in two jobs:

- in place: node b keeps ``--kills`` spares; rank 0 stays in its process, a spare of node b
  takes rank 1, both restore from memory;
- cold: no spare; the launchers restart both processes (interpreter, imports, process group,
  model), which restore from memory.

The time from the kill to the next step both ranks completed, in parts (medians, seconds):
detection (the kill until the launcher has told every node), leaving (in place: rank 0's
training function interrupted, its groups torn down; cold: the processes stopped and new ones
started until their script runs), imports (cold: the script's imports), rendezvous (until the
new process group is formed), setup (model, optimizer, Checkpointer), restore
(``load_latest``), first step (it waits for the slower rank): rank 0's times, which add up to
the total.

python benchmarks/recovery.py --kills 5
"""

from __future__ import annotations

import time

_T_SCRIPT = time.time()  # the process runs the script: imports start

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402 - the optimizer's import, counted with the others
import torch.distributed as dist  # noqa: E402

import unickpt  # noqa: E402
import unickpt.checkpointer  # noqa: E402 - the Checkpointer's imports, counted likewise
from unickpt.launch import current_epoch  # noqa: E402

_T_RECOVER = 0.0  # when the script calls unickpt.recover


def model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    return net, torch.optim.Adam(net.parameters(), lr=1e-4)


def train_step(net: torch.nn.Module, opt: torch.optim.Optimizer, step: int, batch: int) -> None:
    g = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    loss = net(torch.randn(batch, 1024, generator=g)).square().mean()
    opt.zero_grad()
    loss.backward()
    for p in net.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
    opt.step()


def _write(path: Path, doc: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(doc) + "\n")


def train(cfg: dict[str, Any]) -> None:
    """One rank under ``unickpt.recover``: restore, train, save every step; log the times."""
    t_train = time.time()
    torch.set_num_threads(1)
    rank, epoch = dist.get_rank(), current_epoch()
    assert epoch is not None
    net, opt = model()
    state: dict[str, Any] = {"model": net, "optim": opt, "step": 0}
    tier = unickpt.MemoryTier(persist_every=cfg.get("persist_every", 10**6), replicas=2)
    ckpt = unickpt.Checkpointer(cfg["root"], keep_last=2, memory=tier)
    t_restore = time.time()
    last = ckpt.load_latest(state)
    t_restored = time.time()
    out = Path(cfg["out"])
    source = ckpt.last_restore.source if ckpt.last_restore else "none"
    entry = {"kind": "train", "rank": rank, "pid": os.getpid(), "epoch": epoch.epoch}
    entry.update(joined_as=epoch.joined_as, restored=last, source=source)
    entry.update(t_script=_T_SCRIPT, t_recover=_T_RECOVER, t_train=t_train)
    entry.update(t_restore=t_restore, t_restored=t_restored)
    entry["recovery"] = asdict(epoch.recovery) if epoch.recovery else None
    _write(out / f"rank-{rank}.jsonl", entry)
    log = Path(cfg["goodput_log"]) if rank == 0 and cfg.get("goodput_log") else None
    if log is not None:  # goodput.py's record of a start
        sources: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(sources, source)
        start = {"start": last, "restore_s": t_restored - t_restore, "sources": sources}
        _write(log, {**start, "at": time.time()})
    elif cfg.get("goodput_log"):
        dist.all_gather_object([None] * dist.get_world_size(), source)
    stalls, steps = [], []
    for step in range(0 if last is None else last + 1, cfg["steps"]):
        t0 = time.perf_counter()
        train_step(net, opt, step, cfg["batch"])
        steps.append(time.perf_counter() - t0)
        state["step"] = step
        t0 = time.perf_counter()
        ckpt.save(step, state)
        stalls.append(time.perf_counter() - t0)
        if rank == 0:
            _write(out / "steps.jsonl", {"step": step, "t": time.time(), "epoch": epoch.epoch})
            if log is not None:
                _write(log, {"step": step})
    ckpt.close()
    if log is not None:
        done = {"done": True, "stall": statistics.median(stalls) if stalls else 0.0}
        _write(log, {**done, "step_s": statistics.median(steps) if steps else 0.0})


class Job:
    """A job of two nodes (a launcher each) on this machine, and what its ranks logged."""

    def __init__(self, cfg: dict[str, Any], spares: tuple[int, int], max_restarts: int) -> None:
        self.cfg, self.out = cfg, Path(cfg["out"])
        self.out.mkdir(parents=True, exist_ok=True)
        cfg_path = self.out / "cfg.json"
        cfg_path.write_text(json.dumps(cfg))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.launchers = []
        for i, name in enumerate("ab"):
            argv = [sys.executable, "-m", "unickpt.cli.main", "run", "--nnodes", "2"]
            argv += ["--node-rank", str(i), "--node-name", name, "--master-port", str(port)]
            argv += ["--spares", str(spares[i]), "--max-restarts", str(max_restarts)]
            argv += ["--stop-timeout", "10", __file__, "--job", str(cfg_path)]
            env = {**os.environ, "UNICKPT_MEMORY_DIR": cfg["dirs"][i]}
            with open(self.out / f"launcher-{name}.log", "wb") as log:
                self.launchers.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))

    def lines(self, name: str) -> list[dict[str, Any]]:
        path = self.out / name
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]

    def wait(self, what: str, found: Any) -> Any:
        """Poll ``found()`` until it returns something."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            value = found()
            if value:
                return value
            if any(p.poll() is not None for p in self.launchers):
                break
            time.sleep(0.01)
        logs = "".join((self.out / f"launcher-{n}.log").read_text() for n in "ab")
        raise RuntimeError(f"waiting for {what}: the job ended or hung\n{logs[-4000:]}")

    def steps_after(self, t: float) -> list[dict[str, Any]]:
        return [x for x in self.lines("steps.jsonl") if x["t"] > t]

    def current(self, rank: int) -> dict[str, Any]:
        return self.lines(f"rank-{rank}.jsonl")[-1]

    def stop(self) -> None:
        for p in self.launchers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.launchers:
            p.wait()


def _parts(job: Job, t_kill: float, first_step: float, epoch: int) -> dict[str, float]:
    """The parts of one recovery: kill to the next step completed (rank 0's view)."""
    r0 = next(x for x in job.lines("rank-0.jsonl") if x["epoch"] == epoch)
    rec = r0["recovery"]
    told = rec["fault_at"]
    if rec["left_at"] is not None:  # in place: rank 0 stayed
        parts = {"leaving": rec["left_at"] - told, "imports": 0.0}
        parts["rendezvous"] = r0["t_train"] - rec["left_at"]
    else:  # a new process (a full restart)
        parts = {"leaving": r0["t_script"] - told, "imports": r0["t_recover"] - r0["t_script"]}
        parts["rendezvous"] = r0["t_train"] - r0["t_recover"]
    parts["detection"] = told - t_kill
    parts["setup"] = r0["t_restore"] - r0["t_train"]
    parts["restore"] = r0["t_restored"] - r0["t_restore"]
    parts["first step"] = first_step - r0["t_restored"]
    parts["total"] = first_step - t_kill
    return parts


def measure(mode: str, a: dict[str, Any]) -> list[dict[str, float]]:
    """Kill rank 1 ``a['kills']`` times in a job of ``mode`` ("in place" or "cold")."""
    base = Path(tempfile.mkdtemp(prefix="recovery-", dir=a["storage"]))
    shm = Path(tempfile.mkdtemp(prefix="recovery-", dir="/dev/shm"))
    cfg = {"root": str(base / "root"), "out": str(base / "out"), "steps": 10**6}
    cfg.update(batch=a["batch"], dirs=[str(shm / "a"), str(shm / "b")])
    spares = (0, a["kills"]) if mode == "in place" else (0, 0)
    job = Job(cfg, spares, max_restarts=a["kills"])
    results = []
    try:
        since = 0.0
        for _ in range(a["kills"]):
            job.wait("warm steps", lambda s=since: len(job.steps_after(s)) >= a["warm"])
            victim = job.current(1)
            epoch = job.current(0)["epoch"]
            t_kill = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            first = job.wait("the next step", lambda e=epoch, t=t_kill: _next(job, e, t))[0]
            results.append(_parts(job, t_kill, first["t"], first["epoch"]))
            since = first["t"]
    finally:
        job.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return results


def _next(job: Job, epoch: int, t_kill: float) -> list[dict[str, Any]]:
    return [x for x in job.steps_after(t_kill) if x["epoch"] > epoch]


ORDER = ["detection", "leaving", "imports", "rendezvous", "setup", "restore", "first step", "total"]


def _row(name: str, rs: list[dict[str, float]]) -> str:
    cells = [f"{statistics.median(r[k] for r in rs):.3f}" for k in ORDER]
    low, high = min(r["total"] for r in rs), max(r["total"] for r in rs)
    return f"| {name} | {len(rs)} | " + " | ".join(cells) + f" ({low:.2f}-{high:.2f}) |"


def main() -> None:
    global _T_RECOVER
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--warm", type=int, default=5, help="steps between a recovery and the next kill")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--storage", default=tempfile.gettempdir(), help="the Checkpointer's root")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.job:
        _T_RECOVER = time.time()
        unickpt.recover(train, json.loads(Path(args.job).read_text()))
        return
    a = {"kills": args.kills, "warm": args.warm, "batch": args.batch, "storage": args.storage}
    runs = {mode: measure(mode, a) for mode in ("in place", "cold")}
    print("| recovery | kills | " + " | ".join(ORDER) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in ORDER) + " |")
    for mode, rs in runs.items():
        print(_row(mode, rs))
    inplace = statistics.median(r["total"] for r in runs["in place"])
    cold = statistics.median(r["total"] for r in runs["cold"])
    ratio = inplace / cold
    print(f"\nkill to next step, in place / cold: {inplace:.3f} / {cold:.3f} s = {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
