"""Run a whole benchmark: one job for the hardware and the in-process systems, one job per peer.

Jobs run one after another, never side by side, each in its own session so a hang can be
ended. Each job's checkpoints live in a fresh folder under ``workdir``, removed afterwards.
"""

from __future__ import annotations

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
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import unickpt
from unickpt.bench.config import BenchConfig
from unickpt.bench.results import (
    STATUS_ERROR,
    STATUS_NOT_INSTALLED,
    STATUS_TIMEOUT,
    BenchReport,
    HardwareResult,
    RunInfo,
    SystemResult,
)
from unickpt.bench.systems.registry import SYSTEMS_BY_NAME

log = logging.getLogger(__name__)

_SETUP_TIMEOUT_S = 600.0
_SHM = Path("/dev/shm")
# Files the peers leave in shared memory when not run under their own launchers.
_SHM_LEFTOVER_MARKERS = ("ckpt_shm",)
# DLRover's saver sockets; stale ones make the next run wait forever on a dead saver.
_SOCKET_DIR = Path(tempfile.gettempdir()) / "ckpt_sock"
_PEER_ENV: dict[str, dict[str, str]] = {
    # bytecheckpoint's load of extra_state calls torch.load without weights_only=False.
    "bytecheckpoint": {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},
}


@dataclass
class _JobOutcome:
    info: dict[str, Any] = field(default_factory=dict)
    hardware: HardwareResult | None = None
    rows: dict[str, SystemResult] = field(default_factory=dict)


def run_bench(config: BenchConfig) -> BenchReport:
    """Measure every system of ``config`` and write the reports under ``config.out``."""
    started = time.monotonic()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    (config.out / "logs").mkdir(parents=True, exist_ok=True)
    local = [n for n in config.systems if not SYSTEMS_BY_NAME[n].peer]
    outcome = _run_job(config, sys.executable, local, hardware=True)
    for name in (n for n in config.systems if SYSTEMS_BY_NAME[n].peer):
        outcome.rows.update(_run_peer(config, name).rows)
    info = RunInfo(
        command=config.command,
        params=int(outcome.info.get("params", config.params)),
        model=dict(outcome.info.get("model", {})),
        world=config.world,
        state_bytes=int(outcome.info.get("state_bytes", 0)),
        torch_version=_torch_version(),
        python_version=platform.python_version(),
        cpu_count=os.cpu_count() or 0,
        machine=platform.machine(),
        started_at=stamp,
        seconds=time.monotonic() - started,
    )
    rows = tuple(outcome.rows[n] for n in config.systems if n in outcome.rows)
    return BenchReport(info, outcome.hardware, rows)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _run_peer(config: BenchConfig, name: str) -> _JobOutcome:
    info = SYSTEMS_BY_NAME[name]
    python = config.peers_python
    if python is None or not Path(python).exists():
        hint = "create it with benchmarks/setup_peers.sh"
        return _single(name, STATUS_NOT_INSTALLED, f"no peers environment ({hint})")
    probe = subprocess.run(
        [python, "-c", f"import {info.module}"],
        capture_output=True,
        text=True,
        env=_job_env(name),
        check=False,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        return _single(name, STATUS_NOT_INSTALLED, f"{info.module}: {last}")
    _clean_peer_leftovers()
    try:
        return _run_job(config, python, [name], hardware=False)
    finally:
        _clean_peer_leftovers()


def _single(name: str, status: str, message: str) -> _JobOutcome:
    row = SystemResult(name, SYSTEMS_BY_NAME[name].label, status, message)
    return _JobOutcome(rows={name: row})


def _job_env(system: str | None) -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(unickpt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env.update(_PEER_ENV.get(system or "", {}))
    return env


def _run_job(config: BenchConfig, python: str, systems: list[str], hardware: bool) -> _JobOutcome:
    """Run ``systems`` in as few jobs as possible: after a crash or a hang, the system that was
    running is recorded as failed and a new job takes the rest."""
    outcome = _JobOutcome()
    remaining = list(systems)
    attempt = 0
    while remaining or (hardware and attempt == 0):
        attempt += 1
        tag = f"{remaining[0] if len(remaining) == 1 else 'main'}-{attempt}"
        status, lines, log_path = _launch(config, python, remaining, hardware and attempt == 1, tag)
        started = _absorb(outcome, lines)
        done = set(outcome.rows)
        remaining = [n for n in remaining if n not in done and n not in started]
        for name in started - done:
            why = STATUS_TIMEOUT if status == STATUS_TIMEOUT else STATUS_ERROR
            outcome.rows[name] = SystemResult(
                name, SYSTEMS_BY_NAME[name].label, why, f"job ended while running; see {log_path}"
            )
        if status != "ok" and not started:
            for name in remaining:
                outcome.rows[name] = SystemResult(
                    name, SYSTEMS_BY_NAME[name].label, STATUS_ERROR, f"job failed; see {log_path}"
                )
            break
    return outcome


def _absorb(outcome: _JobOutcome, lines: list[dict[str, Any]]) -> set[str]:
    started: set[str] = set()
    for line in lines:
        kind = line.pop("kind")
        if kind == "info":
            outcome.info = line
        elif kind == "hardware":
            outcome.hardware = HardwareResult.from_dict(line)
        elif kind == "start":
            started.add(line["name"])
        elif kind == "system":
            outcome.rows[line["name"]] = SystemResult.from_dict(line)
    return started


def _launch(
    config: BenchConfig, python: str, systems: list[str], hardware: bool, tag: str
) -> tuple[str, list[dict[str, Any]], Path]:
    workdir = config.workdir / f"job-{tag}"
    results = workdir / "results.jsonl"
    log_path = config.out / "logs" / f"{tag}.log"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    command = [python, "-m", "unickpt.bench.job", "--params", str(config.params)]
    command += ["--world", str(config.world), "--systems", ",".join(systems)]
    command += ["--workdir", str(workdir), "--results", str(results)]
    command += ["--seq-len", str(config.seq_len)]
    command += ["--hardware"] if hardware else []
    command += [] if config.warmup else ["--no-warmup"]
    timeout_s = _SETUP_TIMEOUT_S + config.system_timeout_s * max(1, len(systems))
    log.info("job %s: %s", tag, " ".join(command))
    status = _wait(
        command, log_path, timeout_s, _job_env(systems[0] if len(systems) == 1 else None)
    )
    lines = _read_lines(results)
    shutil.rmtree(workdir, ignore_errors=True)
    return status, lines, log_path


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
