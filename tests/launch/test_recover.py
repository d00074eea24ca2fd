"""Recovery without restarting the job: real launchers (two nodes on this machine, each with
its own memory folder), real processes, real kills at points the job signals.

Each run checks that every loss a rank computed, before and after each failure, is bit for bit
that of an undisturbed run, that the survivors of an in-process recovery kept their processes,
and that each fallback to a full restart was taken, and said why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_ranks
from tests.launch import job

JOB = str(Path(job.__file__))
TIMEOUT_S = 600.0  # a bound for a loaded machine; a passing run stays far below


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Run:
    """One job under ``unickpt run``: one launcher per node, its log, the ranks' records."""

    def __init__(
        self, tmp: Path, nodes: list[tuple[str, int, int]], steps: int, waits: dict, model: str
    ) -> None:
        self.tmp, self.out = tmp, tmp / "out"
        self.out.mkdir()
        cfg = {"root": str(tmp / "root"), "out": str(self.out), "steps": steps, "waits": waits}
        cfg["model"] = model
        (tmp / "cfg.json").write_text(json.dumps(cfg))
        port = _port()
        self.logs = [tmp / f"{name}.log" for name, _, _ in nodes]
        self.launchers = []
        for i, (name, nproc, spares) in enumerate(nodes):
            argv = [sys.executable, "-m", "unickpt.cli.main", "run", "--nnodes", str(len(nodes))]
            argv += ["--node-rank", str(i), "--nproc-per-node", str(nproc), "--spares"]
            argv += [str(spares), "--node-name", name, "--master-port", str(port)]
            argv += ["--recovery-timeout", "60", "--stop-timeout", "10", JOB, str(tmp / "cfg.json")]
            env = {**os.environ, "UNICKPT_MEMORY_DIR": str(self.memory(name))}
            with open(self.logs[i], "wb") as log:
                self.launchers.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
        self.deadline = time.monotonic() + TIMEOUT_S

    def memory(self, node: str) -> Path:
        return self.tmp / f"shm-{node}"

    def text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs)

    def wait_for(self, pattern: str) -> re.Match[str]:
        """The first line of the launchers' logs that matches, once there."""
        while True:
            found = re.search(pattern, self.text())
            if found:
                return found
            self._check_alive(pattern)
            time.sleep(0.05)

    def marker(self, tag: str) -> int:
        """The pid of the rank waiting at ``tag``, once it waits."""
        path = self.out / tag
        while not (path.exists() and path.read_text()):
            self._check_alive(f"the wait {tag}")
            time.sleep(0.05)
        return int(path.read_text())

    def pid(self, slot: str) -> int:
        return int(self.wait_for(rf"started slot {re.escape(slot)} \(.*\), pid (\d+)").group(1))

    def _check_alive(self, what: str) -> None:
        ended = [p.poll() for p in self.launchers]
        if any(c is not None for c in ended) or time.monotonic() > self.deadline:
            self.stop()
            raise AssertionError(f"waiting for {what}, launchers {ended}:\n{self.text()[-6000:]}")

    def finish(self) -> None:
        for p in self.launchers:
            try:
                p.wait(max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise AssertionError(f"the job did not end:\n{self.text()[-6000:]}") from None
        codes = [p.returncode for p in self.launchers]
        assert codes == [0] * len(codes), f"launchers exited {codes}:\n{self.text()[-6000:]}"

    def stop(self) -> None:
        for p in self.launchers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.launchers:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    def epochs(self) -> dict[int, dict[int, dict[str, Any]]]:
        """Per epoch and rank: the pid that trained it, the step restored and its source."""
        found: dict[int, dict[int, dict[str, Any]]] = {}
        for line in (self.out / "epochs.jsonl").read_text().splitlines():
            x = json.loads(line)
            found.setdefault(x.pop("epoch"), {}).setdefault(x.pop("rank"), {}).update(x)
        return found

    def check_losses(self, reference: list[list[str]]) -> None:
        """Every loss each rank computed, on every try of a step, is the undisturbed run's."""
        for rank, want in enumerate(reference):
            lines = (self.out / f"loss-{rank}.jsonl").read_text().splitlines()
            seen = [json.loads(x) for x in lines]
            assert {x["step"] for x in seen} == set(range(len(want))), rank
            for x in seen:
                assert x["loss"] == want[x["step"]], (rank, x, want[x["step"]])


@pytest.mark.slow
def test_failures_between_saves_in_a_save_without_spares_and_while_recovering(
    tmp_path: Path,
) -> None:
    reference = run_ranks(2, job.reference, 11)
    waits = {
        "between": {"step": 2, "rank": 0, "where": "after_save"},
        "asleep": {"step": 2, "rank": 1, "where": "sleep"},
        "in-save": {"step": 4, "rank": 1, "where": "in_save"},
        "no-spare": {"step": 6, "rank": 0, "where": "after_save"},
        "recovering": {"step": 8, "rank": 0, "where": "after_save"},
    }
    run = Run(tmp_path, [("a", 1, 1), ("b", 1, 1)], 11, waits, "ddp")
    try:
        # Rank 0 dies between saves while rank 1 sleeps outside any collective: rank 1 is
        # interrupted, and node a's spare takes rank 0.
        first = {0: run.marker("between"), 1: run.marker("asleep")}
        os.kill(first[0], signal.SIGKILL)
        # Rank 1 dies inside its memory save (rank 0 waits in the save's collective): node b's
        # spare takes it.
        os.kill(run.marker("in-save"), signal.SIGKILL)
        # Rank 0 dies with no spare left: a full restart.
        os.kill(run.marker("no-spare"), signal.SIGKILL)
        # In the new generation node a's spare, frozen, is given rank 0 when rank 0 dies, and
        # dies before the process group forms: a failure during recovery, a full restart.
        frozen = run.pid("1.0.1")
        os.kill(frozen, signal.SIGSTOP)
        os.kill(run.marker("recovering"), signal.SIGKILL)
        run.wait_for(r"epoch 4: rank 0 -> slot 1\.0\.1")
        os.kill(frozen, signal.SIGKILL)
        run.finish()
    finally:
        run.stop()
    log = run.text()
    assert "full restart 1 of at most 3: no spare left: 1 rank(s) lost (0), 0 spare(s)" in log
    assert "full restart 2 of at most 3: rank 0 (slot 1.0.1) died while epoch 4 formed" in log
    run.check_losses(reference)
    e = run.epochs()
    assert sorted(e) == [0, 1, 2, 3, 5]  # epoch 4 never formed
    spare_a, spare_b = run.pid("0.0.1"), run.pid("0.1.1")
    assert {r: e[0][r]["pid"] for r in (0, 1)} == first
    assert {r: e[1][r]["pid"] for r in (0, 1)} == {0: spare_a, 1: first[1]}  # rank 1 stayed
    assert {r: e[2][r]["pid"] for r in (0, 1)} == {0: spare_a, 1: spare_b}  # rank 0 stayed
    assert {r: e[3][r]["pid"] for r in (0, 1)} == {0: run.pid("1.0.0"), 1: run.pid("1.1.0")}
    assert {r: e[5][r]["pid"] for r in (0, 1)} == {0: run.pid("2.0.0"), 1: run.pid("2.1.0")}
    # Each restore took the newest committed step from memory: the save in flight at the
    # second failure (step 4) rolled back to step 3.
    restored = {n: sorted({(x["restored"], x["source"]) for x in e[n].values()}) for n in e}
    assert restored == {
        0: [(None, "none")],
        1: [(2, "memory")],
        2: [(3, "memory")],
        3: [(6, "memory")],
        5: [(8, "memory")],
    }


@pytest.mark.slow
def test_a_lost_node_is_replaced_by_spares_of_another_node(tmp_path: Path) -> None:
    """FSDP2 on a mesh of every rank: its DTensors' layouts (cached by mesh) and groups are
    made anew in the next membership."""
    reference = run_ranks(4, job.reference, 6, "fsdp2")
    waits = {f"lost-{r}": {"step": 3, "rank": r, "where": "after_save"} for r in (2, 3)}
    run = Run(tmp_path, [("a", 2, 2), ("b", 2, 0)], 6, waits, "fsdp2")
    try:
        lost = [run.marker("lost-2"), run.marker("lost-3")]
        for pid in lost:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(run.memory("b"))  # node b is gone with its memory
        run.finish()
    finally:
        run.stop()
    run.check_losses(reference)
    e = run.epochs()
    assert sorted(e) == [0, 1]
    assert [e[0][r]["pid"] for r in (2, 3)] == lost
    assert [e[1][r]["pid"] for r in range(4)] == [
        e[0][0]["pid"],
        e[0][1]["pid"],
        run.pid("0.0.2"),
        run.pid("0.0.3"),
    ]
    # Ranks 2 and 3 now live on node a, whose memory holds node b's replicas.
    assert {(x["restored"], x["source"]) for x in e[1].values()} == {(3, "memory")}
    assert not run.memory("b").exists()
