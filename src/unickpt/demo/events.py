"""What a training run reports while it runs.

Rank 0 of each phase emits these to an :data:`EventSink`; the launcher adds
:class:`WorkerKilled`. All are small frozen dataclasses that pickle across processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseStarted:
    phase: str
    label: str
    world_size: int
    end_step: int
    num_parameters: int


@dataclass(frozen=True)
class Loaded:
    """A checkpoint was loaded (``step`` is None when none was committed yet)."""

    phase: str
    step: int | None
    load_s: float


@dataclass(frozen=True)
class StepDone:
    """``loss`` is the mean over the whole global batch, the same on every rank."""

    phase: str
    step: int
    loss: float


@dataclass(frozen=True)
class SaveStarted:
    """``save()`` returned: the state is captured and training goes on."""

    phase: str
    step: int
    blocking_s: float


@dataclass(frozen=True)
class SaveDurable:
    """The save of ``step`` is committed; ``durable_s`` counts from the call to ``save()``."""

    phase: str
    step: int
    durable_s: float
    size_bytes: int


@dataclass(frozen=True)
class PhaseFinished:
    phase: str
    last_step: int
    elapsed_s: float


@dataclass(frozen=True)
class WorkerKilled:
    """The launcher sent SIGKILL to ``rank`` right after the save of ``step`` started."""

    phase: str
    rank: int
    pid: int
    step: int


Event = PhaseStarted | Loaded | StepDone | SaveStarted | SaveDurable | PhaseFinished | WorkerKilled
EventSink = Callable[[Event], None]


def discard(event: Event) -> None:
    """An event sink for ranks other than 0."""
