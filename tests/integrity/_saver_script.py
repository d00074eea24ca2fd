"""A process that saves checkpoints in a loop, to be killed at random instants.

Run as ``python _saver_script.py serve``: it imports torch and unickpt once, then reads one
JSON command per line on stdin and answers one JSON line on stdout:

- ``{"cmd": "run", "mode": M, "root": R, "report": F, "start": N, "seed": S}`` forks a worker
  that saves steps ``N, N + 1, ...`` and answers ``{"pid": P}``. ``M`` is ``"sync"`` or
  ``"async"`` (a :class:`unickpt.Checkpointer` on root ``R``), ``"single"`` (``unickpt.save``
  into folder ``R`` with ``overwrite=True``), ``"incr-sync"`` or ``"incr-async"`` (the same
  with ``incremental=True``: a frozen tensor is referred to, not written again, and of a
  table only the changed rows are written) or
  ``"hold"`` (a Checkpointer on ``R`` saves step ``N``, which takes the root's lock, reports
  ``locked`` and sleeps). After each committed
  save the worker appends ``committed N`` to ``F``.
- ``{"cmd": "reap", "pid": P}`` waits for worker ``P`` and answers
  ``{"pid": P, "signal": SIG, "code": CODE}``.

Forking from one warm process keeps a kill trial at milliseconds instead of the seconds an
import of torch takes. The state's tensors encode the step, so every checkpoint's content is
known: see :func:`set_step` and :func:`check_step`.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
import traceback
import zlib
from typing import Any

import torch

import unickpt

KEEP_LAST = 3
FULL_EVERY = 3
INCREMENTAL = ("incr-sync", "incr-async")
FROZEN_NUMEL = 600_000  # a frozen tensor of a few checksum segments, never written twice


TABLE_ROWS = 1000  # an embedding-like table: step s changes row s % TABLE_ROWS only


def frozen_values() -> torch.Tensor:
    return (torch.arange(FROZEN_NUMEL, dtype=torch.int64) % 9973).to(torch.float32)


def table_values(step: int) -> torch.Tensor:
    """Row r holds the last step t <= ``step`` with t % TABLE_ROWS == r (-1 before any)."""
    rows = torch.arange(TABLE_ROWS, dtype=torch.int64)
    last = step - (step - rows) % TABLE_ROWS
    return torch.where(last >= 0, last, -1).to(torch.float32)[:, None].expand(-1, 64).clone()


def open_root(root: str, mode: str) -> unickpt.Checkpointer:
    """The Checkpointer a worker of ``mode`` saves with (and the test checks with)."""
    return unickpt.Checkpointer(
        root,
        keep_last=KEEP_LAST,
        mode="async" if mode in ("async", "incr-async") else "sync",
        incremental=mode in INCREMENTAL,
        full_every=FULL_EVERY,
        row_deltas=["table"] if mode in INCREMENTAL else (),
    )


def build_state() -> dict[str, Any]:
    """A model, an Adam optimizer with its state created, and a progress counter."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    progress = {"step": -1, "tag": "none", "t": torch.zeros(4, dtype=torch.int64)}
    table = table_values(-1)
    return {
        "model": model,
        "optim": opt,
        "progress": progress,
        "frozen": frozen_values(),
        "table": table,
    }


def named_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` by a stable name (parameters, optimizer state, counter)."""
    model, opt = state["model"], state["optim"]
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"model.{name}"] = p
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{name}.{k}"] = v
    out["progress.t"] = state["progress"]["t"]
    return out


def pattern(step: int, name: str, like: torch.Tensor) -> torch.Tensor:
    """The values tensor ``name`` holds at ``step``: exact in float32 below step 16000."""
    salt = zlib.crc32(name.encode()) % 1000
    n = like.numel()
    base = (torch.arange(n, dtype=torch.int64) * 7 + salt) % 1009 + step * 1024
    return base.to(like.dtype).reshape(like.shape)


def set_step(state: dict[str, Any], step: int) -> None:
    with torch.no_grad():
        for name, t in named_tensors(state).items():
            t.copy_(pattern(step, name, t))
        state["table"].copy_(table_values(step))
    state["progress"]["step"] = step
    state["progress"]["tag"] = f"step-{step}"


def check_step(state: dict[str, Any]) -> tuple[int, list[str]]:
    """The step the state claims, and the names whose values are not exactly that step's."""
    step = state["progress"]["step"]
    wrong = [
        name
        for name, t in named_tensors(state).items()
        if not torch.equal(t, pattern(step, name, t))
    ]
    if state["progress"]["tag"] != f"step-{step}":
        wrong.append(f"progress.tag={state['progress']['tag']!r}")
    if not torch.equal(state["frozen"], frozen_values()):
        wrong.append("frozen")
    if not torch.equal(state["table"], table_values(step)):
        wrong.append("table")
    return step, wrong


def _report(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def _work(mode: str, root: str, report: str, start: int, seed: int) -> None:
    torch.set_num_threads(1)
    rng = random.Random(seed)
    fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    state = build_state()
    if mode == "single":
        step = start
        while True:
            set_step(state, step)
            unickpt.save(root, state, overwrite=True)
            _report(fd, f"committed {step}")
            step += 1
    ckpt = open_root(root, mode)
    if mode == "hold":  # a writer: its first save takes the root's lock
        set_step(state, start)
        ckpt.save(start, state).wait()
        _report(fd, "locked")
        while True:
            time.sleep(1)
    step = start
    while True:
        set_step(state, step)
        fut = ckpt.save(step, state)
        set_step(state, step + 1)  # training goes on while the save runs in the background
        if rng.random() < 0.5:
            time.sleep(rng.random() * 0.01)
        fut.wait()
        _report(fd, f"committed {step}")
        step += 1


def _run_worker(cmd: dict[str, Any]) -> None:
    code = 0
    try:
        _work(cmd["mode"], cmd["root"], cmd["report"], cmd["start"], cmd["seed"])
    except BaseException:  # noqa: BLE001 - reported to the test, which expected a kill
        with open(cmd["report"], "a") as f:
            f.write("error " + traceback.format_exc().replace("\n", " | ") + "\n")
        code = 1
    finally:
        os._exit(code)


def _warm_up() -> None:
    """Run one save and load here, so forked workers find every lazy import already done."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        state = build_state()
        set_step(state, 0)
        with unickpt.Checkpointer(tmp, mode="sync") as ckpt:
            ckpt.save(0, state)
            ckpt.load_latest(state)


def serve() -> None:
    _warm_up()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "run":
            pid = os.fork()
            if pid == 0:
                _run_worker(cmd)
            answer: dict[str, Any] = {"pid": pid}
        else:
            _, status = os.waitpid(cmd["pid"], 0)
            signal = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
            answer = {"pid": cmd["pid"], "signal": signal, "code": code}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] != ["serve"]:
        sys.exit("usage: python _saver_script.py serve")
    serve()
