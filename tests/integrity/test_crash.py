"""Crash safety: savers killed with SIGKILL at random instants never lose a committed step.

A warm process forks workers that save in a loop (see ``_saver_script.py``); each is killed
after a random delay, then the test loads what is on disk, checks it bitwise against the step
its values encode, saves once more into the same place and checks nothing was left behind.
"""

from __future__ import annotations

import os
import random
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

import unickpt
from tests.integrity._helpers import debris, tmp_files
from tests.integrity._procs import SaverServer, committed_steps, wait_for_line
from tests.integrity._saver_script import (
    FULL_EVERY,
    INCREMENTAL,
    KEEP_LAST,
    build_state,
    check_step,
    open_root,
    set_step,
)

TRIALS = int(os.environ.get("INTEGRITY_KILL_TRIALS", "25"))
# A worker commits a step every 20 to 40 ms here (about 9 in 0.3 s): a kill within 0.15 s of its
# start still falls anywhere in its opening of the root and in several saves (a chain of
# incremental ones too, whose window opens after two commits), and the module waits half as long.
MAX_DELAY_S = 0.15
SENTINEL = -7


def _kill_after_random_delay(
    server: SaverServer, mode: str, root: Path, report: Path, start: int, rng: random.Random
) -> list[str]:
    pid = server.start(mode, root, report, start, rng.randrange(1 << 30))
    if mode in INCREMENTAL:  # a chain is under way: a full save, then one referring to it
        wait_for_line(report, f"committed {start + 1}", 60.0)
    time.sleep(rng.uniform(0.0, MAX_DELAY_S))
    ended = server.kill(pid)
    if ended["signal"] != signal.SIGKILL:
        return [f"the worker was not killed but ended with {ended}; see {report}"]
    return []


def _step_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step-*") if p.is_dir())


def _check_root_after_kill(
    root: Path, state: dict[str, Any], floor: int, mode: str
) -> tuple[int, list[str], bool]:
    """Load the newest step, save the next, check the root is clean.

    ``floor`` is the newest step known committed (-1: none). Returns the step saved here, the
    problems found, and whether the kill had left a save unfinished.
    """
    problems: list[str] = []
    interrupted = any(not (p / "COMMIT").exists() for p in _step_folders(root))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = open_root(str(root), "incr-sync" if mode in INCREMENTAL else "sync")
        # retention also keeps the steps that kept incremental checkpoints refer to
        most = KEEP_LAST + (FULL_EVERY - 1 if mode in INCREMENTAL else 0)
        try:
            set_step(state, SENTINEL)
            newest = ckpt.steps()[-1] if ckpt.steps() else None
            step = ckpt.load_latest(state)
            if step is None:
                if floor >= 0:
                    problems.append(f"nothing loaded, but step {floor} was committed")
                nxt = 0
            else:
                got, wrong = check_step(state)
                if got != step or wrong:
                    problems.append(f"step {step} loaded with values of {got}; wrong: {wrong}")
                if step < floor:
                    problems.append(f"loaded step {step}, but step {floor} was committed")
                if step != newest:
                    problems.append(f"loaded step {step}, but the newest committed is {newest}")
                nxt = step + 1
            set_step(state, nxt)
            ckpt.save(nxt, state)
            steps = ckpt.steps()
            if steps[-1] != nxt or len(steps) > most:
                problems.append(f"after saving step {nxt} the committed steps are {steps}")
        finally:
            ckpt.close()
    problems += [f"warning: {w.message}" for w in caught]
    for folder in _step_folders(root):
        if not (folder / "COMMIT").exists():
            problems.append(f"{folder.name} has no COMMIT after a finished save")
        elif debris(folder):
            problems.append(f"{folder.name} holds debris {debris(folder)}")
    if tmp_files(root):
        problems.append(f"temporary files left: {tmp_files(root)}")
    set_step(state, SENTINEL)
    with unickpt.Checkpointer(root) as again:
        if again.load_latest(state) != nxt or check_step(state) != (nxt, []):
            problems.append(f"step {nxt}, just saved, does not load back")
    return nxt, problems, interrupted


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async", *INCREMENTAL])
def test_checkpointer_survives_sigkill(
    mode: str, tmp_path: Path, saver_server: SaverServer, rng: random.Random
) -> None:
    root = tmp_path / "run"
    state = build_state()
    floor, start = -1, 0
    failures: list[str] = []
    interrupted = committed = 0
    for trial in range(TRIALS):
        report = tmp_path / f"report-{trial}.txt"
        problems = _kill_after_random_delay(saver_server, mode, root, report, start, rng)
        reported = committed_steps(report)
        committed += len(reported)
        floor = max([floor, *reported])
        saved, found, was_interrupted = _check_root_after_kill(root, state, floor, mode)
        interrupted += was_interrupted
        failures += [f"trial {trial}: {p}" for p in problems + found]
        floor, start = saved, saved + 1
    survived = TRIALS - len({f.split(":")[0] for f in failures})
    print(
        f"Checkpointer {mode}: {TRIALS} kill trials, {survived} survived; {committed} steps "
        f"committed by the workers, {interrupted} kills left a save unfinished"
    )
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
def test_single_folder_overwrite_survives_sigkill(
    tmp_path: Path, saver_server: SaverServer, rng: random.Random
) -> None:
    path = tmp_path / "ckpt"
    state = build_state()
    set_step(state, 0)
    unickpt.save(path, state)
    known = 0
    failures: list[str] = []
    old = new = 0
    for trial in range(TRIALS):
        report = tmp_path / f"report-{trial}.txt"
        problems = _kill_after_random_delay(saver_server, "single", path, report, known + 1, rng)
        last = max([known, *committed_steps(report)])
        set_step(state, SENTINEL)
        try:
            unickpt.load(path, state)
        except unickpt.CheckpointError as e:
            problems.append(f"the folder does not load after the kill: {e}")
        else:
            got, wrong = check_step(state)
            if got not in (last, last + 1) or wrong:
                problems.append(f"loaded step {got} (wrong: {wrong}); expected {last} or next")
            old += got == last
            new += got == last + 1
            known = got
        known += 1
        set_step(state, known)
        unickpt.save(path, state, overwrite=True)
        names = sorted(p.name for p in path.iterdir())
        if debris(path) or tmp_files(path):
            problems.append(f"the folder holds {names} after a finished save")
        set_step(state, SENTINEL)
        unickpt.load(path, state)
        if check_step(state) != (known, []):
            problems.append(f"step {known}, just saved, does not load back")
        failures += [f"trial {trial}: {p}" for p in problems]
    survived = TRIALS - len({f.split(":")[0] for f in failures})
    print(
        f"single-folder overwrite: {TRIALS} kill trials, {survived} survived; the folder held "
        f"the old values {old} times and the new values {new} times"
    )
    assert not failures, "\n".join(failures)
