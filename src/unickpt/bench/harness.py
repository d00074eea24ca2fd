"""Run a whole benchmark: one job for the hardware, then one job per run of each system.

Every run of every system is its own job, in fresh processes, so no system inherits memory,
caches or helper processes from another. Systems alternate: each repeat runs every system once,
in an order rotated by one from the previous repeat (:func:`schedule`), so a slow spell of the
machine spreads over all of them. Jobs run one after another, never side by side, each in its
own session so a hang can be ended; each job's checkpoints live in a fresh folder under
``workdir``, removed afterwards. A run that crashes or hangs costs only that run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import unickpt
from unickpt.bench.config import BenchConfig
from unickpt.bench.model import config_for_params
from unickpt.bench.results import (
    STATUS_ERROR,
    STATUS_NOT_INSTALLED,
    STATUS_SKIPPED,
    STATUS_TIMEOUT,
    BenchReport,
    HardwareResult,
    RunInfo,
    RunResult,
    SystemResult,
    summarize,
)
from unickpt.bench.systems.registry import SYSTEMS_BY_NAME

log = logging.getLogger(__name__)

_SETUP_TIMEOUT_S = 600.0
_SHM = Path("/dev/shm")
# Files the peers leave in shared memory when not run under their own launchers.
_SHM_LEFTOVER_MARKERS = ("ckpt_shm",)
# DLRover's saver sockets; stale ones make the next run wait forever on a dead saver.
_SOCKET_DIR = Path(tempfile.gettempdir()) / "ckpt_sock"


def _system_env(system: str) -> dict[str, str]:
    """Environment a system's job needs (settings some peers read only from there)."""
    if system == "bytecheckpoint":
        from unickpt.config import get_config

        return {
            # Its load of extra_state calls torch.load without weights_only=False.
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1",
            # Its writer threads, read once at import: as many as unickpt's.
            "BYTECHECKPOINT_STORE_WORKER_COUNT": str(get_config().io_threads),
        }
    return {}


@dataclass
class _Job:
    """What one job reported."""

    status: str
    info: dict[str, Any] = field(default_factory=dict)
    hardware: HardwareResult | None = None
    run: RunResult | None = None
    failure: tuple[str, str] | None = None
    notes: str = ""


@dataclass
class _Runs:
    """Everything measured of one system so far."""

    results: list[RunResult] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)
    notes: str = ""


def schedule(systems: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, system) in the order they run: every repeat runs each system once, starting one
    further along the list than the repeat before.

    >>> schedule(["a", "b", "c"], 2)
    [(0, 'a'), (0, 'b'), (0, 'c'), (1, 'b'), (1, 'c'), (1, 'a')]
    """
    order: list[tuple[int, str]] = []
    for repeat in range(repeats):
        shift = repeat % len(systems) if systems else 0
        order += [(repeat, name) for name in systems[shift:] + systems[:shift]]
    return order


def run_bench(config: BenchConfig, progress: Callable[[str], None] | None = None) -> BenchReport:
    """Measure every system of ``config``; the reports are written by ``write_outputs``.
    ``progress`` is told of each job as it starts (the CLI prints it)."""
    tell = progress or log.info
    started = time.monotonic()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    (config.out / "logs").mkdir(parents=True, exist_ok=True)
    if config.device == "cuda" and not _cuda_available():
        return _report(config, stamp, started, _Job("skipped"), _skipped_rows(config))
    tell("measuring the hardware")
    setup = _launch(config, sys.executable, "", 0)
    # The first run's guess: the hardware job, which builds the same state and writes it.
    longest_s = time.monotonic() - started
    runs: dict[str, _Runs] = {name: _Runs() for name in config.systems}
    rows: dict[str, SystemResult] = {}
    for name in config.systems:
        missing = _missing_peer(config, name)
        if missing:
            rows[name] = _row(name, STATUS_NOT_INSTALLED, missing)
    plan = schedule([n for n in config.systems if n not in rows], config.repeats)
    for index, (repeat, name) in enumerate(plan, 1):
        if not within_budget(time.monotonic() - started, longest_s, config.time_budget_s):
            tell(f"time budget of {config.time_budget_s:g} s spent: {len(plan) - index + 1} runs")
            _skip_rest(runs, plan[index - 1 :], config.time_budget_s)
            break
        tell(f"run {index}/{len(plan)}: {name} (repeat {repeat + 1} of {config.repeats})")
        job_started = time.monotonic()
        _record(runs[name], _run_once(config, name, repeat))
        longest_s = max(longest_s, time.monotonic() - job_started)
    for name in config.systems:
        if name not in rows:
            info = SYSTEMS_BY_NAME[name]
            got = runs[name]
            rows[name] = summarize(name, info.label, got.notes, got.results, got.failures)
    return _report(config, stamp, started, setup, [rows[n] for n in config.systems])


def within_budget(elapsed_s: float, longest_run_s: float, budget_s: float | None) -> bool:
    """Whether another run may start: the time spent plus the longest run so far stays within
    the budget (always, without one).

    >>> within_budget(100.0, 30.0, 120.0), within_budget(100.0, 30.0, None)
    (False, True)
    """
    return budget_s is None or elapsed_s + longest_run_s <= budget_s


def _skip_rest(runs: dict[str, _Runs], rest: list[tuple[int, str]], budget_s: float | None) -> None:
    """The runs the time budget left out count as skipped runs of their systems."""
    why = f"not started: the time budget of {budget_s:g} s was spent (--time-budget)"
    for _, name in rest:
        runs[name].failures.append((STATUS_SKIPPED, why))


def _record(runs: _Runs, job: _Job) -> None:
    runs.notes = job.notes or runs.notes
    if job.run is not None:
        runs.results.append(job.run)
    else:
        runs.failures.append(job.failure or (job.status, "the job reported nothing"))


def _report(
    config: BenchConfig, stamp: str, started: float, setup: _Job, rows: list[SystemResult]
) -> BenchReport:
    model = setup.info.get("model") or dataclasses.asdict(config_for_params(config.params))
    info = RunInfo(
        command=config.command,
        params=int(setup.info.get("params", config.params)),
        model=dict(model),
        world=config.world,
        state_bytes=int(setup.info.get("state_bytes", 0)),
        torch_version=_torch_version(),
        python_version=platform.python_version(),
        cpu_count=os.cpu_count() or 0,
        machine=platform.machine(),
        started_at=stamp,
        seconds=time.monotonic() - started,
        repeats=config.repeats,
        device=config.device,
        gpu_available=_cuda_available(),
    )
    return BenchReport(info, setup.hardware, tuple(rows))


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _skipped_rows(config: BenchConfig) -> list[SystemResult]:
    why = "--device cuda, but no CUDA device is visible (torch.cuda.is_available() is False)"
    log.warning("skipping every system: %s", why)
    return [_row(name, STATUS_SKIPPED, why) for name in config.systems]


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _row(name: str, status: str, message: str) -> SystemResult:
    return SystemResult(name, SYSTEMS_BY_NAME[name].label, status, message)


def _missing_peer(config: BenchConfig, name: str) -> str:
    """Why a peer system cannot run here, or "" when it can (or is not a peer)."""
    info = SYSTEMS_BY_NAME[name]
    if not info.peer:
        return ""
    python = config.peers_python
    if python is None or not Path(python).exists():
        return "no peers environment (create it with benchmarks/setup_peers.sh)"
    probe = subprocess.run(
        [python, "-c", f"import {info.module}"],
        capture_output=True,
        text=True,
        env=_job_env(name),
        check=False,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"{info.module}: {last}"
    return ""


def _job_env(system: str | None) -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(unickpt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env.update(_system_env(system or ""))
    return env


def _run_once(config: BenchConfig, name: str, repeat: int) -> _Job:
    info = SYSTEMS_BY_NAME[name]
    if not info.peer:
        return _launch(config, sys.executable, name, repeat)
    assert config.peers_python is not None
    _clean_peer_leftovers()
    try:
        return _launch(config, config.peers_python, name, repeat)
    finally:
        _clean_peer_leftovers()


def _launch(config: BenchConfig, python: str, system: str, repeat: int) -> _Job:
    """One job: the hardware and the state's size when ``system`` is "", else one run."""
    tag = f"{system}-{repeat + 1}" if system else "hardware"
    workdir = config.workdir / f"job-{tag}"
    results = workdir / "results.jsonl"
    log_path = config.out / "logs" / f"{tag}.log"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    command = [python, "-m", "unickpt.bench.job", "--params", str(config.params)]
    command += ["--world", str(config.world), "--device", config.device]
    command += ["--workdir", str(workdir), "--results", str(results)]
    command += ["--seq-len", str(config.seq_len)]
    command += ["--system", system] if system else ["--hardware"]
    command += [] if config.warmup else ["--no-warmup"]
    log.info("job %s: %s", tag, " ".join(command))
    status = _wait(command, log_path, _SETUP_TIMEOUT_S + config.system_timeout_s, _job_env(system))
    job = _absorb(_Job(status), _read_lines(results))
    shutil.rmtree(workdir, ignore_errors=True)
    if job.run is None and job.failure is None and system:
        why = "timed out" if status == STATUS_TIMEOUT else "ended before reporting"
        job.failure = (status if status != "ok" else STATUS_ERROR, f"job {why}; see {log_path}")
    return job


def _absorb(job: _Job, lines: list[dict[str, Any]]) -> _Job:
    for line in lines:
        kind = line.pop("kind")
        if kind == "info":
            job.info = line
        elif kind == "hardware":
            job.hardware = HardwareResult.from_dict(line)
        elif kind == "run":
            job.run = RunResult.from_dict(line["run"])
            job.notes = line.get("notes", "")
        elif kind == "failed":
            job.failure = (line["status"], line["message"])
            job.notes = line.get("notes", "")
    return job


def _wait(command: list[str], log_path: Path, timeout_s: float, env: dict[str, str]) -> str:
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.error("job exceeded %.0f s; ending it (log: %s)", timeout_s, log_path)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return STATUS_TIMEOUT
    if code != 0:
        log.error("job exited with %d (log: %s)", code, log_path)
        return STATUS_ERROR
    return "ok"


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines: list[dict[str, Any]] = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            log.warning("ignoring a truncated results line in %s", path)
    return lines


def _clean_peer_leftovers() -> None:
    """Remove checkpoint buffers a peer left in /dev/shm, and its saver sockets."""
    shutil.rmtree(_SOCKET_DIR, ignore_errors=True)
    if not _SHM.is_dir():
        return
    for entry in _SHM.iterdir():
        if any(marker in entry.name for marker in _SHM_LEFTOVER_MARKERS):
            log.info("removing shared-memory leftover %s", entry)
            entry.unlink(missing_ok=True)
