"""Restarts with real processes: crash, node loss, elastic, both copies lost, SIGTERM."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import torch

import unickpt
from tests.distributed import run_ranks, start_process, start_ranks
from tests.tiers import faults, workers


def _kill(procs: list[multiprocessing.Process]) -> None:
    for p in procs:
        p.kill()  # SIGKILL: no handler, no exit hook runs
    for p in procs:
        p.join(30)
        assert p.exitcode == -signal.SIGKILL


def test_crash_restart_from_memory_then_close(tmp_path: Path) -> None:
    shm, root = tmp_path / "shm", str(tmp_path / "store")
    other = shm / "other-job-0123456789ab" / "step-000000001"
    other.mkdir(parents=True)  # another job's memory checkpoint on the node
    (other / "COMMIT").write_text("theirs")
    dirs = {0: str(shm), 1: str(shm)}
    procs, names = start_ranks(2, workers.save_steps, root, dirs, None, [1, 2, 3, 4, 5], 100)
    _kill(procs)
    steps = [n for n in names[0] if n.count("/") == 1 and "step-" in n]
    assert [n.rsplit("/", 1)[1] for n in steps if "other" not in n] == [
        "step-000000004",
        "step-000000005",
    ]  # the newest complete one and the one after it: never more
    assert not Path(root).exists() or not list(Path(root).glob("step-*"))  # memory only
    results = run_ranks(2, workers.restart, root, dirs, None, 16, True)
    assert results == [(5, "memory"), (5, "memory")]
    assert sorted(p.name for p in shm.iterdir()) == ["other-job-0123456789ab"]
    assert (other / "COMMIT").read_text() == "theirs"
    assert unickpt.Checkpointer(root).steps() == [5]  # close persisted what storage lacked
    # ... and what it persisted is step 5 whole, from that one moment (the commit the restore
    # chose), into one process: bit for bit
    whole = workers.state(-1, 0, 1, 16)
    unickpt.load(unickpt.Checkpointer(root).path(5), whole)
    workers.check(whole, 5, 0, 1, 16)


def test_node_loss_peers_elastic_and_storage_fallback(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    a, b = str(tmp_path / "node-a"), str(tmp_path / "node-b")
    nodes = {0: "a", 1: "a", 2: "b", 3: "b"}
    dirs = {0: a, 1: a, 2: b, 3: b}
    procs, _ = start_ranks(4, workers.save_steps, root, dirs, nodes, [1, 2, 3], 2)
    _kill(procs)
    assert unickpt.Checkpointer(root).steps() == [2]  # the second save was persisted
    shutil.rmtree(b)  # node b is lost with its memory
    results = run_ranks(4, workers.restart, root, dirs, nodes, 32, False, False, True)
    assert [r[:2] for r in results] == [(3, "memory"), (3, "memory"), (3, "peer"), (3, "peer")]
    # Each rank of node b receives the index files of what it reads only: its own rows' file
    # and rank 0's (which holds the replicated bias), never rank 1's. Rank 0's data file comes
    # once to the node (both ranks read it). What moves grows with what a rank loads, not with
    # the world's size.
    suffixes = [sorted(n.rsplit("-", 1)[1] for n in r[2]) for r in results]
    assert suffixes == [
        [],
        [],
        ["00000.bin", "00000.json", "00002.bin", "00002.json"],
        ["00000.json", "00003.bin", "00003.json"],
    ]
    # Into another layout (split by columns) every rank of node b reads part of every file:
    # it receives every index; each data file comes once to the node, whole, into its folder.
    shutil.rmtree(b)
    results = run_ranks(4, workers.restart, root, dirs, nodes, 32, False, True, True)
    assert [r[:2] for r in results] == [(3, "memory"), (3, "memory"), (3, "peer"), (3, "peer")]
    indexes = [sorted(n for n in r[2] if n.startswith("index-")) for r in results]
    assert indexes[:2] == [[], []] and len(indexes[2]) == 4 and indexes[3] == indexes[2]
    data = sorted(n for r in results for n in r[2] if n.startswith("data-"))
    assert len(data) == 4 == len(set(data))
    # fewer ranks and nodes: node a's memory (its own files and node b's replicas) reshards
    one = {0: a, 1: a}
    assert run_ranks(2, workers.restart, root, one, {0: "a", 1: "a"}, 32, False) == [
        (3, "memory"),
        (3, "memory"),
    ]
    # Node b lost again, and node a's copy of rank 3's index damaged: the rank that receives
    # it refuses it, and every rank falls back to storage together (none waits for the others).
    shutil.rmtree(b)
    (index,) = Path(a).rglob("step-000000003/index-*-00003.json")
    raw = bytearray(index.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    index.write_bytes(bytes(raw))
    results = run_ranks(4, workers.restart, root, dirs, nodes, 32, False)
    assert results == [(2, "storage")] * 4
    shutil.rmtree(a)
    shutil.rmtree(b, ignore_errors=True)  # both copies lost: storage's newest
    results = run_ranks(4, workers.restart, root, dirs, nodes, 32, False)
    assert results == [(2, "storage")] * 4


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sigterm_persists_newest_memory_step(tmp_path: Path) -> None:
    root, shm, ready = str(tmp_path / "store"), str(tmp_path / "shm"), tmp_path / "ready"
    ready.mkdir()
    port = _port()
    procs = [
        start_process(workers.entry_signalled, r, 2, port, root, shm, str(ready), daemon=True)
        for r in range(2)
    ]
    deadline = time.monotonic() + 180
    while len(list(ready.iterdir())) < 2:
        assert time.monotonic() < deadline and all(p.is_alive() for p in procs)
        time.sleep(0.1)
    for p in procs:
        os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [-signal.SIGTERM] * 2  # ended as SIGTERM ends
    stored = unickpt.Checkpointer(root).steps()
    job = next(Path(shm).iterdir())
    in_memory = sorted(int(p.name[5:]) for p in job.glob("step-*") if (p / "COMMIT").exists())
    assert stored and stored[-1] == in_memory[-1] >= 3
    empty = {0: str(tmp_path / "fresh"), 1: str(tmp_path / "fresh")}
    results = run_ranks(2, workers.restart, root, empty, None, 16, True)
    assert results == [(stored[-1], "storage")] * 2
    assert torch.equal(workers.full(0), workers.full(0))


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def test_wait_returns_only_once_the_replica_is_renamed_and_a_crash_before_loses_nothing(
    tmp_path: Path,
) -> None:
    """Rank 1 holds the rename of rank 0's replica of step 2 (its index) into place. Neither
    rank's ``wait()`` returns while it is held (each waits for every rank's replicas); once it
    is let go, both return. Killed in that window with node a lost, the restart loads step 1,
    the step ``wait()`` last reported committed (rank 0's copy of step 2 was not whole on
    node b: the replica's index never landed)."""
    nodes = {0: "a", 1: "b"}
    for kill_in_window in (False, True):
        run = tmp_path / f"run-{kill_in_window}"
        dirs = {0: str(run / "node-a"), 1: str(run / "node-b")}
        flags = run / "flags"
        flags.mkdir(parents=True)
        procs, _ = start_ranks(
            2, faults.save_with_a_replica_held, str(run / "store"), dirs, nodes, str(flags)
        )
        try:
            _wait_for(flags / "holding")
            time.sleep(2.0)  # room for a wait() that would return early (it must not)
            assert sorted(p.name for p in flags.iterdir()) == ["holding"]
            if not kill_in_window:
                (flags / "open").touch()
                _wait_for(flags / "returned-0")
                _wait_for(flags / "returned-1")
        finally:
            _kill(procs)
        shutil.rmtree(dirs[0])  # node a is lost with its memory
        results = run_ranks(
            2, workers.restart, str(run / "store"), dirs, nodes, 16, False, timeout_s=300
        )
        if kill_in_window:
            assert results == [(1, "peer"), (1, "memory")]
        else:
            assert results == [(2, "peer"), (2, "memory")]
