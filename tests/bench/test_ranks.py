"""The benchmarks' rank processes, forked from a fork server: each starts in the environment and
on the CPUs its caller has when it starts it (not the server's), and runs its exit hooks."""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

import pytest

from unickpt.bench import ranks

pytestmark = pytest.mark.usefixtures("tests_fork_server")

_PROBE = "UNICKPT_BENCH_RANK_PROBE"


def _report(q: Any) -> None:
    q.put((os.environ.get(_PROBE), sorted(os.sched_getaffinity(0))))


def _leave_a_mark(path: str) -> None:
    atexit.register(Path(path).write_text, "exit hooks ran")


def _started(target: Any, *args: Any) -> Any:
    ctx = ranks.context()
    q = ctx.Queue()
    proc = ranks.start(ctx, target, *args, q)
    found = q.get(timeout=120)
    proc.join(timeout=120)
    assert proc.exitcode == 0
    return found


def test_a_rank_has_the_environment_of_its_start_not_the_servers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.delenv(_PROBE, raising=False)
    assert _started(_report) == (None, cpus)
    monkeypatch.setenv(_PROBE, "set after the server started")
    assert _started(_report) == ("set after the server started", cpus)


def test_a_rank_runs_its_exit_hooks(tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    ctx = ranks.context()
    proc = ranks.start(ctx, _leave_a_mark, str(mark))
    proc.join(timeout=120)
    assert proc.exitcode == 0
    assert mark.read_text() == "exit hooks ran"
