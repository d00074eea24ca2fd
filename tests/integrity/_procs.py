"""Processes for the integrity tests: a warm saver to fork and kill, ranks that may die."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.distributed import context, take_environment

SCRIPT = Path(__file__).with_name("_saver_script.py")


class SaverServer:
    """``_saver_script.py serve`` in a subprocess; forks saver workers on demand."""

    def __init__(self, log_path: Path) -> None:
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    def _ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the saver server exited (code {self.proc.poll()})")
        return dict(json.loads(line))

    def start(self, mode: str, root: Path, report: Path, start: int, seed: int) -> int:
        """Fork a worker saving steps ``start, start + 1, ...``; its pid."""
        cmd = {"cmd": "run", "mode": mode, "root": str(root), "report": str(report)}
        return int(self._ask({**cmd, "start": start, "seed": seed})["pid"])

    def kill(self, pid: int) -> dict[str, Any]:
        """SIGKILL worker ``pid`` and wait until it is gone; how it ended."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return self._ask({"cmd": "reap", "pid": pid})

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def wait_for_line(path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.01)
    raise AssertionError(f"{path} did not get {text!r} within {timeout_s} s")


def committed_steps(report: Path) -> list[int]:
    """Steps a worker reported committed (its ``wait()`` returned); errors fail the test."""
    if not report.exists():
        return []
    steps = []
    for line in report.read_text().splitlines():
        if line.startswith("error"):
            raise AssertionError(f"the saver worker failed: {line}")
        if line.startswith("committed "):
            steps.append(int(line.split()[1]))
    return steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    q: Any,
    environ: dict[str, str],
) -> None:
    take_environment(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        q.put((rank, True, fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - sent to the test
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    # A peer may be gone: tearing the process group down could wait on it. Flush and leave.
    q.close()
    q.join_thread()
    os._exit(0)


def run_ranks_some_die(
    world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 90.0
) -> dict[int, Any]:
    """Like ``tests.distributed.run_ranks``, but ranks may die: their exit code is returned.

    Returns ``{rank: result}`` for ranks that finished and ``{rank: ("exit", code)}`` for
    ranks that ended without a result; any rank still alive after ``timeout_s`` (a hang)
    fails the caller.
    """
    ctx = context()
    q = ctx.Queue()
    port, environ = _free_port(), dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, q, environ))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(errors) < world and time.monotonic() < deadline:
            if not q.empty():
                rank, ok, value = q.get()
                if ok:
                    out[rank] = value
                else:
                    errors.append(f"rank {rank}: {value}")
                continue
            for r, p in enumerate(procs):
                if r not in out and not p.is_alive() and q.empty():
                    out[r] = ("exit", p.exitcode)
            time.sleep(0.02)
        hung = [r for r, p in enumerate(procs) if p.is_alive() and r not in out]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    if hung:
        raise AssertionError(f"ranks {hung} still running after {timeout_s} s: a hang")
    return out
