"""The demo's settings in one validated dataclass, and the phases they imply."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from unickpt.demo.corpus import VOCAB_SIZE
from unickpt.demo.model import GPTConfig


class DemoError(Exception):
    """The demo could not run as configured, or a training process failed."""


@dataclass(frozen=True)
class DemoConfig:
    """Everything the demo does is decided here.

    The run: ``steps`` optimizer steps, a checkpoint every ``save_every`` steps, a worker killed
    right after the save of step ``kill_at``, a resume on one process until step ``regrow_at``,
    then two processes again until ``steps``. ``kill_at`` and ``regrow_at`` default to about
    40% and 70% of the run. Checkpoints, chart and summary go to ``out_dir`` (by default
    ``out/demo`` of the current folder, which the repository's ``.gitignore`` covers).

    Example::

        >>> DemoConfig(steps=60, save_every=5).kill_step, DemoConfig(steps=60).regrow_step
        (25, 40)
    """

    out_dir: str = os.path.join("out", "demo")
    steps: int = 60
    save_every: int = 5
    kill_at: int | None = None
    regrow_at: int | None = None
    world_size: int = 2
    seed: int = 0
    model: GPTConfig = field(default_factory=lambda: GPTConfig(vocab_size=VOCAB_SIZE))
    batch_size: int = 16
    micro_batches: int = 2
    lr: float = 1e-3
    warmup_steps: int = 5
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    corpus_chars: int = 200_000
    keep_last: int | None = 3
    loss_tolerance: float = 1e-3

    def __post_init__(self) -> None:
        if self.save_every < 1 or self.steps < 4 * self.save_every:
            raise DemoError(
                f"steps={self.steps} with save_every={self.save_every} leaves too few saves; "
                "use at least four saves per run (steps >= 4 * save_every)"
            )
        for name, value in (("kill_at", self.kill_step), ("regrow_at", self.regrow_step)):
            if value % self.save_every:
                raise DemoError(
                    f"{name}={value} is not a multiple of save_every={self.save_every}; "
                    "the demo kills and regrows on save steps"
                )
        if not 0 < self.kill_step < self.regrow_step < self.steps:
            raise DemoError(
                f"need 0 < kill_at ({self.kill_step}) < regrow_at ({self.regrow_step}) < "
                f"steps ({self.steps}); pick values in that order"
            )
        if self.world_size < 2 or self.micro_batches % self.world_size:
            raise DemoError(
                f"world_size={self.world_size} must be at least 2 and divide "
                f"micro_batches={self.micro_batches}"
            )
        if self.batch_size % self.micro_batches:
            raise DemoError(
                f"batch_size={self.batch_size} is not a multiple of "
                f"micro_batches={self.micro_batches}"
            )

    @property
    def kill_step(self) -> int:
        """The step after whose save a worker is killed."""
        if self.kill_at is not None:
            return self.kill_at
        return max(2 * self.save_every, _round_to(self.steps * 0.4, self.save_every))

    @property
    def regrow_step(self) -> int:
        """The step at which the run goes back from one process to ``world_size``."""
        if self.regrow_at is not None:
            return self.regrow_at
        return max(self.kill_step + self.save_every, _round_to(self.steps * 0.7, self.save_every))

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.out_dir, "checkpoints")


@dataclass(frozen=True)
class Phase:
    """One launch of training processes.

    ``resume``: load the newest committed checkpoint first. ``checkpoint``: save every
    ``save_every`` steps. ``kill_at``: the launcher kills rank ``world_size - 1`` with SIGKILL
    as soon as rank 0 has started the save of that step, then stops the other ranks.
    """

    name: str
    label: str
    world_size: int
    end_step: int
    checkpoint: bool
    resume: bool
    kill_at: int | None = None


def plan_phases(config: DemoConfig) -> list[Phase]:
    """The reference run, then the run that is killed, shrunk to one process, and regrown."""
    ws, many = config.world_size, processes_label(config.world_size)
    return [
        Phase("reference", f"reference, {many}", ws, config.steps, False, False),
        Phase("train", f"train, {many}", ws, config.steps, True, False, config.kill_step),
        Phase("resume-1", f"resume, {processes_label(1)}", 1, config.regrow_step, True, True),
        Phase(f"resume-{ws}", f"resume, {many}", ws, config.steps, True, True),
    ]


def processes_label(world_size: int) -> str:
    """``"1 process"``, ``"2 processes"``."""
    return "1 process" if world_size == 1 else f"{world_size} processes"


def _round_to(value: float, multiple: int) -> int:
    return round(value / multiple) * multiple
