"""A training script for ``unickpt run``: a small model under DDP or FSDP2, a memory tier, and
points where a rank waits until the test kills or interrupts it.

``python job.py CONFIG`` (a JSON file): ``root`` (the Checkpointer's root), ``out`` (where the
ranks write), ``steps``, ``model`` (``"ddp"`` or ``"fsdp2"``), and ``waits``:
``{tag: {"step": s, "rank": r, "where": w}}``, each taken once in the whole run (the first rank
to reach it writes ``out/<tag>`` with its pid):

- ``after_save``: after step ``s``'s save is committed, sleep until killed;
- ``in_save``: inside step ``s``'s save (the state's ``gate`` object is being captured),
  sleep until killed, while the other ranks wait in that save's collectives;
- ``sleep``: after step ``s``'s save is committed, sleep until interrupted (a survivor
  outside any collective when another rank fails).

Each rank appends to ``out/loss-<rank>.jsonl`` one line per step trained (the loss bit for bit,
the epoch, the pid), and to ``out/epochs.jsonl`` one line per call of ``train``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import unickpt
from unickpt.launch import current_epoch


def model_and_optimizer(kind: str = "ddp") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model wrapped for this membership's process group (DDP, or FSDP2 over a mesh of
    every rank), and its optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    if kind == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)
    # DDP whose gradient buckets keep their first layout: by default it lays them out again
    # after the first iteration, so a rank resumed in a new DDP would sum one step's gradients
    # in another order than an undisturbed run, and differ in the last bits (a restart of any
    # kind does).
    wrapped = DistributedDataParallel(model, find_unused_parameters=True)
    return wrapped, torch.optim.Adam(model.parameters(), lr=0.01)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


def reference(rank: int, world: int, steps: int, kind: str = "ddp") -> list[str]:
    """The losses of an undisturbed run on ``world`` ranks (a rank of ``run_ranks``)."""
    torch.set_num_threads(1)
    model, opt = model_and_optimizer(kind)
    return [train_step(model, opt, step, rank).hex() for step in range(steps)]


class Gate:
    """A stateful object in the state: its capture by a save is where ``in_save`` waits."""

    def __init__(self, cfg: dict[str, Any], rank: int) -> None:
        self.cfg, self.rank, self.step = cfg, rank, -1

    def state_dict(self) -> dict[str, Any]:
        wait(self.cfg, self.rank, self.step, "in_save")
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])


def wait(cfg: dict[str, Any], rank: int, step: int, where: str) -> None:
    """Take the wait of ``cfg`` for (``step``, ``rank``, ``where``) once: sleep until killed or
    interrupted."""
    for tag, w in cfg["waits"].items():
        if (w["step"], w["rank"], w["where"]) != (step, rank, where):
            continue
        marker = Path(cfg["out"]) / tag
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue  # taken already, before a failure
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        while True:
            time.sleep(0.05)


def train(cfg: dict[str, Any]) -> int:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    epoch = current_epoch()
    assert epoch is not None
    out = Path(cfg["out"])
    with open(out / "epochs.jsonl", "a") as f:
        f.write(json.dumps({"epoch": epoch.epoch, "rank": rank, "pid": os.getpid()}) + "\n")
    model, opt = model_and_optimizer(cfg.get("model", "ddp"))
    gate = Gate(cfg, rank)
    state = {"model": model, "optim": opt, "gate": gate}
    tier = unickpt.MemoryTier(persist_every=cfg.get("persist_every", 3), replicas=2)
    ckpt = unickpt.Checkpointer(cfg["root"], keep_last=2, memory=tier)
    last = ckpt.load_latest(state)
    source = ckpt.last_restore.source if ckpt.last_restore else "none"
    with open(out / "epochs.jsonl", "a") as f:
        f.write(
            json.dumps({"epoch": epoch.epoch, "rank": rank, "restored": last, "source": source})
        )
        f.write("\n")
    for step in range(0 if last is None else last + 1, cfg["steps"]):
        loss = train_step(model, opt, step, rank)
        with open(out / f"loss-{rank}.jsonl", "a") as f:
            line = {"step": step, "loss": loss.hex(), "epoch": epoch.epoch, "pid": os.getpid()}
            f.write(json.dumps(line) + "\n")
        gate.step = step
        ckpt.save(step, state)
        for where in ("after_save", "sleep"):
            if any(w["where"] == where and w["step"] == step for w in cfg["waits"].values()):
                ckpt.wait()
                wait(cfg, rank, step, where)
    ckpt.close()
    return rank


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)  # kill -USR2: where a rank hangs
    unickpt.recover(train, json.loads(Path(sys.argv[1]).read_text()))
