"""The memory tier beside DLRover's flash checkpoint: save stall, replica time, restores.

Each rank holds ``--mib`` MiB of float32 tensors (16 MiB each). Rows, medians over
``--saves`` saves after a first one that allocates:

- save stall: how long ``save`` blocks the training thread (unickpt: the call of
  ``Checkpointer.save`` with a MemoryTier; DLRover: ``save_checkpoint(..., MEMORY)``, its copy
  into shared memory);
- replica on the peer: two ranks as two nodes (``UNICKPT_NODE``) on this machine, from the call
  until ``fut.wait()`` returns (the memory copy and the partner's replica committed), beside the
  raw gloo transfer of what replication moves: each rank's bytes to the other, one way then the
  other (the raw one-way transfer is the link figure of the restore row);
- restore from local memory (median of ``--restores``): a new process loads the newest step
  into zeroed tensors (unickpt, ``load_latest``), once with checksums verified (the default) and
  once without (``verify=False``: DLRover verifies none); DLRover: ``load_checkpoint()`` then
  the copy of its shared-memory tensors into the state, twice: in a new process, the saver
  running in a separate long-lived process as ``dlrover-run``'s agent runs it (the training
  processes set ``ROLE_NAME=dlrover-trainer``), which is the restart a memory tier is for; and
  in the process that saved, without an agent (its saver then lives in the training process
  and ends with it: a new process finds no memory checkpoint);
- the floor of a local restore on this host, in a new process, best of 3: the bytes of the
  newest step's data file copied into tensors like the state's by the engine's threads
  (``io_threads``) out of a fresh memory map of the file, one checksum segment at a time (the
  engine's path for files in memory), the same with every segment hashed right after its copy
  (the least a verified restore does), both again read with ``pread`` instead, and DLRover's
  way (a fresh map copied into them by ``Tensor.copy_``);
- restore from a peer (median of ``--restores``): node b's memory folder deleted, both ranks
  restart; node b's rank fetches its files from node a and loads; timed from the call of
  ``load_latest`` (both processes started and past a barrier, so neither counts the other's
  start) until the state holds the values (checked afterwards).

With ``--pin-nodes`` the two-node rows run each node's process on a CPU of its own, the nearest
one machine comes to two hosts.

unickpt bench --memory-tier --memory-mib 256 --peers-python .venv-peers/bin/python
python benchmarks/memory_tier.py --mib 256 --peers-python .venv-peers/bin/python
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import unickpt
from unickpt.bench import ranks
from unickpt.config import get_config
from unickpt.engine.checksum import digest
from unickpt.format.dtypes import buffer_of

PIECE_MIB = 16


def _state(mib: int, value: float, rank: int, world: int) -> dict[str, Any]:
    """This rank's row of ``mib // 16`` global tensors (each rank's bytes are its own)."""
    n, cols = max(1, mib // PIECE_MIB), PIECE_MIB << 18
    return {
        f"t{i}": unickpt.ShardedTensor(torch.full((1, cols), value + i), (world, cols), (rank, 0))
        for i in range(n)
    }


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _save_job(rank: int, world: int, port: int, a: dict[str, Any], q: Any) -> None:
    _init(rank, world, port)
    os.environ["UNICKPT_NODE"] = f"node-{rank}"
    reps = int(os.environ.get("PROBE_REPLICAS", world))
    tier = unickpt.MemoryTier(persist_every=10**6, replicas=reps, dir=a["dirs"][rank])
    ckpt = unickpt.Checkpointer(a["root"], memory=tier)
    state = _state(a["mib"], float(rank), rank, world)
    stalls, replicated = [], []
    for step in range(a["saves"] + 1):
        for t in state.values():
            t.local.add_(1)  # the training step
        dist.barrier()
        t0 = time.perf_counter()
        fut = ckpt.save(step, state)
        stalls.append(time.perf_counter() - t0)
        fut.wait()
        replicated.append(time.perf_counter() - t0)
    link, both = [], []
    if world == 2:
        buf = torch.zeros(a["mib"] << 20, dtype=torch.uint8)
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
            link.append(time.perf_counter() - t0)
            dist.send(buf, 0) if rank == 1 else dist.recv(buf, 1)
            both.append(time.perf_counter() - t0)
    result = {"stall": stalls[1:], "replicated": replicated[1:], "link": link, "both": both}
    q.put((rank, result))
    dist.destroy_process_group()


def _restore_job(rank: int, world: int, port: int, a: dict[str, Any], q: Any) -> None:
    _init(rank, world, port)
    os.environ["UNICKPT_NODE"] = f"node-{rank}"
    tier = unickpt.MemoryTier(persist_every=10**6, replicas=world, dir=a["dirs"][rank])
    config = get_config(verify=a.get("verify", True))
    ckpt = unickpt.Checkpointer(a["root"], memory=tier, config=config)
    state = _state(a["mib"], -1.0, rank, world)
    dist.barrier()  # both processes started: neither counts the other's start
    t0 = time.perf_counter()
    step = ckpt.load_latest(state)
    seconds = time.perf_counter() - t0
    info = ckpt.last_restore
    assert info is not None and step is not None and step == a["saves"], (step, info)
    assert float(state["t0"].local[0, 0]) == rank + step + 1, "restored values differ"
    q.put((rank, {"restore": seconds, "source": info.source}))
    dist.destroy_process_group()


def _floor_job(rank: int, world: int, port: int, a: dict[str, Any], q: Any) -> None:
    """The floor of a local restore: the newest data file of node folder ``a["dirs"][0]`` into
    tensors like the state's by ``io_threads`` threads, copied out of a fresh memory map a
    segment at a time, or read (whole), each with and without every segment hashed, and by
    ``Tensor.copy_`` out of a fresh map (DLRover's way); best of 3, seconds."""
    data = max(Path(a["dirs"][0]).glob("*/step-*/data-*.bin"), key=lambda p: p.parent.name)
    config = get_config()
    seg = config.segment_bytes
    dests = [t.local.reshape(-1).view(torch.uint8) for t in _state(a["mib"], 0.0, 0, 1).values()]
    n = dests[0].numel()  # the state's tensors are all one size
    size = min(data.stat().st_size, n * len(dests))
    spans = [(i * n, d[: max(0, min(n, size - i * n))]) for i, d in enumerate(dests)]
    fd = os.open(data, os.O_RDONLY)

    def read(hashed: bool) -> None:
        def one(span: tuple[int, torch.Tensor]) -> None:
            at, dest = span
            out = buffer_of(dest)
            step = seg if hashed else max(1, len(out))
            for pos in range(0, len(out), step):
                piece = out[pos : pos + step]
                os.preadv(fd, [piece], at + pos)
                if hashed:
                    digest(piece)  # as the engine checks a segment

        with ThreadPoolExecutor(config.io_threads) as pool:
            list(pool.map(one, spans))

    def map_copy(hashed: bool) -> None:
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)

        def one(span: tuple[int, torch.Tensor]) -> None:
            at, dest = span
            out = dest.numpy()
            if not len(out):
                return
            src = np.frombuffer(mm, dtype=np.uint8, count=len(out), offset=at)
            for pos in range(0, len(out), seg):
                piece = out[pos : pos + seg]
                np.copyto(piece, src[pos : pos + seg])
                if hashed:
                    digest(memoryview(piece))  # type: ignore[arg-type]

        with ThreadPoolExecutor(config.io_threads) as pool:
            list(pool.map(one, spans))
        mm.close()

    def mapped() -> None:
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only: only copied from
            src = torch.frombuffer(mm, dtype=torch.uint8)
        for at, dest in spans:
            dest.copy_(src[at : at + dest.numel()])
        del src
        mm.close()

    best = {
        "map_copy": _best(lambda: map_copy(False)),
        "map_copy_hashed": _best(lambda: map_copy(True)),
        "read": _best(lambda: read(False)),
        "read_hashed": _best(lambda: read(True)),
        "mapped_copy": _best(mapped),
    }
    os.close(fd)
    q.put((rank, best))


def _best(run: Any, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def _spawn(world: int, fn: Any, a: dict[str, Any], pin: bool = False) -> list[dict[str, Any]]:
    """Run ``fn`` on ``world`` ranks, each a new process (:mod:`unickpt.bench.ranks`); with
    ``pin``, rank r's process on CPU ``r`` alone (as if each rank were a host of its own)."""
    ctx = ranks.context()
    q = ctx.Queue()
    port = ranks.free_port()
    cpus = sorted(os.sched_getaffinity(0))
    procs = [
        ranks.start(ctx, fn, r, world, port, a, q, cpus={cpus[r % len(cpus)]} if pin else None)
        for r in range(world)
    ]
    out = dict(q.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join()
    return [out[r] for r in range(world)]


# DLRover's side. Modes: "standalone" (its saver in this process: saves, then restores here),
# "save" and "load" (its saver in a separate agent process, as ``dlrover-run`` starts it: one
# process saves and exits, each restore is a new process finding the checkpoint in the agent's
# memory). Arguments: mode, MiB, saves, port, checkpoint folder, restores.
_DLROVER = r"""
import json, os, sys, time, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], RANK="0", WORLD_SIZE="1")
import torch.distributed as dist
dist.init_process_group("gloo")
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
mode, mib, saves = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
n = max(1, mib // 16)
state = {f"t{i}": torch.full((16 << 18,), float(i)) for i in range(n)}
ckpt = DdpCheckpointer(sys.argv[5])
result = {"stall": [], "restore": []}
if mode != "load":
    for step in range(saves + 1):
        for t in state.values():
            t.add_(1)
        t0 = time.perf_counter()
        ckpt.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
        result["stall"].append(time.perf_counter() - t0)
    del result["stall"][0]  # the first save allocates
if mode == "save":
    time.sleep(1)  # the agent takes the last step's metadata
else:
    expected = state if mode == "standalone" else {k: v + saves + 1 for k, v in state.items()}
    for _ in range(int(sys.argv[6])):
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        loaded = ckpt.load_checkpoint()
        for k, v in dest.items():
            v.copy_(loaded[k])
        result["restore"].append(time.perf_counter() - t0)
        assert all(torch.equal(dest[k], expected[k]) for k in state), "values differ"
print("RESULT " + json.dumps(result), flush=True)
if mode != "standalone":  # as a killed trainer: no teardown that could touch the agent's memory
    os._exit(0)  # (standalone, the normal exit ends the saver process it started)
"""

_DLROVER_AGENT = r"""
from dlrover.trainer.torch.flash_checkpoint.engine import start_async_save
start_async_save()
"""


def _dlrover_run(python: str, mode: str, env: dict[str, str], *args: object) -> Any:
    cmd = [python, "-c", _DLROVER, mode, *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    return _result(done)


def _result(done: subprocess.CompletedProcess[str]) -> dict[str, Any] | None:
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return result


def _dlrover_cleanup(job: str) -> None:
    """What DLRover leaves behind after its processes ended: shared memory and sockets."""
    for leftover in Path("/dev/shm").glob(f"{job}_*"):
        leftover.unlink(missing_ok=True)
    shutil.rmtree(f"/tmp/ckpt_sock/{job}", ignore_errors=True)


def _dlrover_env(job: str, **extra: str) -> dict[str, str]:
    # DLRover names its shared memory and sockets after the job
    return {
        **os.environ,
        "TORCHELASTIC_RUN_ID": job,
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        **extra,
    }


def _dlrover_in_process(python: str, mib: int, saves: int, work: Path, restores: int) -> Any:
    job = f"unickpt-bench-{os.getpid()}"
    try:
        args = (mib, saves, ranks.free_port(), work / "dlrover", restores)
        return _dlrover_run(python, "standalone", _dlrover_env(job), *args)
    finally:
        _dlrover_cleanup(job)


def _dlrover_restarted(python: str, mib: int, saves: int, work: Path, restores: int) -> Any:
    """Stall and new-process restores with DLRover's saver in its own agent process."""
    job = f"unickpt-bench-agent-{os.getpid()}"
    agent_env = _dlrover_env(job)
    agent = subprocess.Popen(
        [python, "-c", _DLROVER_AGENT], env=agent_env, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while not any(Path(f"/tmp/ckpt_sock/{job}").glob("*")):  # the agent's sockets are up
            if agent.poll() is not None or time.monotonic() > deadline:
                print("DLRover's agent did not start", file=sys.stderr)
                return None
            time.sleep(0.1)
        env = _dlrover_env(job, ROLE_NAME="dlrover-trainer")  # the agent saves, not the trainer
        folder = work / "dlrover-agent"
        saved = _dlrover_run(python, "save", env, mib, saves, ranks.free_port(), folder, 0)
        loads = [
            _dlrover_run(python, "load", env, mib, saves, ranks.free_port(), folder, 1)
            for _ in range(restores)
        ]
        if saved is None or any(x is None for x in loads):
            return None
        return {"stall": saved["stall"], "restore": [x["restore"][0] for x in loads]}
    finally:
        agent.kill()
        agent.wait()
        _dlrover_cleanup(job)


def _dlrover(python: str, mib: int, saves: int, work: Path, restores: int) -> dict[str, Any] | None:
    """DLRover's figures: ``stall``/``restore`` with its agent (the restore in a new process),
    ``stall_in_process``/``restore_in_process`` without one (the restore where it saved)."""
    restarted = _dlrover_restarted(python, mib, saves, work, restores)
    in_process = _dlrover_in_process(python, mib, saves, work, restores)
    if restarted is None or in_process is None:
        return None
    return {
        **restarted,
        "stall_in_process": in_process["stall"],
        "restore_in_process": in_process["restore"],
    }


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ms"


def measure(
    mib: int, saves: int, peers_python: str | None, restores: int = 3, pin_nodes: bool = False
) -> dict[str, Any]:
    """Every row's figures (seconds), DLRover's under ``"dlrover"`` when ``peers_python``;
    each restore ``restores`` times (from a peer: node b's memory deleted before each). With
    ``pin_nodes``, the two-node rows (replica, link, restore from a peer) run each node's
    process on a CPU of its own."""
    work = Path(tempfile.mkdtemp(prefix="unickpt-memory-bench-", dir="/dev/shm"))
    try:
        rows: dict[str, Any] = {"mib_per_rank": mib, "pin_nodes": pin_nodes}
        one: dict[str, Any] = {"root": str(work / "store1"), "dirs": {0: str(work / "m1")}}
        a = {**one, "mib": mib, "saves": saves}
        local = _spawn(1, _save_job, a)[0]
        rows["unickpt_stall"] = local["stall"]
        rows["unickpt_restore_local"] = [
            _spawn(1, _restore_job, a)[0]["restore"] for _ in range(restores)
        ]
        rows["unickpt_restore_local_unverified"] = [
            _spawn(1, _restore_job, {**a, "verify": False})[0]["restore"] for _ in range(restores)
        ]
        rows["floor_local"] = _spawn(1, _floor_job, a)[0]
        dirs = {0: str(work / "ma"), 1: str(work / "mb")}
        two: dict[str, Any] = {"root": str(work / "store2"), "dirs": dirs}
        b = {**two, "mib": mib, "saves": saves}
        pair = _spawn(2, _save_job, b, pin_nodes)
        rows["unickpt_replicated"] = pair[0]["replicated"] + pair[1]["replicated"]
        rows["link"] = pair[0]["link"]
        rows["link_both_ways"] = pair[0]["both"]
        peer = []
        for _ in range(restores):
            shutil.rmtree(two["dirs"][1], ignore_errors=True)  # node b's memory is lost
            back = _spawn(2, _restore_job, b, pin_nodes)
            assert back[1]["source"] == "peer", back
            peer.append(back[1]["restore"])
        rows["unickpt_restore_peer"] = peer
        if peers_python:
            rows["dlrover"] = _dlrover(peers_python, mib, saves, work, restores)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def to_markdown(rows: dict[str, Any]) -> str:
    """The rows as a markdown table, unickpt beside DLRover."""
    d = rows.get("dlrover") or {}

    def theirs(key: str) -> str:
        return _ms(d[key]) if d.get(key) else "n/a"

    lines = [
        f"| memory tier ({rows['mib_per_rank']} MiB per rank) | unickpt "
        "| DLRover flash checkpoint |",
        "| --- | --- | --- |",
        f"| save stall (DLRover: with its agent; without: {theirs('stall_in_process')}) | "
        f"{_ms(rows['unickpt_stall'])} | {theirs('stall')} |",
        f"| replica committed on the peer (raw link, each rank's bytes to the other: "
        f"{_ms(rows['link_both_ways'])}) | "
        f"{_ms(rows['unickpt_replicated'])} | n/a (no replicas in memory) |",
        "| restore from local memory in a new process (DLRover: from its agent) | "
        f"{_ms(rows['unickpt_restore_local'])} | {theirs('restore')} |",
        "| restore from local memory, checksums not verified (DLRover has none) | "
        f"{_ms(rows['unickpt_restore_local_unverified'])} | {theirs('restore')} |",
        "| DLRover without an agent: restore in the process that saved | n/a "
        f"| {theirs('restore_in_process')} |",
        _floor_row(rows.get("floor_local")),
        f"| restore from a peer (raw link: {_ms(rows['link'])}"
        f"{'; each node on a CPU of its own' if rows.get('pin_nodes') else ''}) | "
        f"{_ms(rows['unickpt_restore_peer'])} | n/a |",
    ]
    return "\n".join(lines)


def _floor_row(floor: dict[str, float] | None) -> str:
    label = (
        "floor of a local restore: the step's data file into the tensors, best of 3 (unickpt "
        "column: copied out of a map a segment at a time, and with every segment hashed, as "
        "the engine does; in brackets, the same read by pread; DLRover column: a fresh map "
        "copied by Tensor.copy_)"
    )
    if not floor:
        return f"| {label} | n/a | n/a |"
    ms = {k: f"{v * 1e3:.1f}" for k, v in floor.items()}
    ours = f"{ms['map_copy']} / {ms['map_copy_hashed']} ms ({ms['read']} / {ms['read_hashed']} ms)"
    return f"| {label} | {ours} | {floor['mapped_copy'] * 1e3:.1f} ms |"


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--mib", type=int, default=256, help="state per rank, MiB")
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--restores", type=int, default=3, help="restores from a peer (median)")
    p.add_argument("--peers-python", default=None, help="python of .venv-peers (DLRover)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument(
        "--pin-nodes",
        action="store_true",
        help="run each of the two nodes' processes on a CPU of its own (as two hosts)",
    )
    args = p.parse_args()
    rows = measure(args.mib, args.saves, args.peers_python, args.restores, args.pin_nodes)
    print(to_markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
