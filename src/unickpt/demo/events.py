"""What a training run reports while it runs.

Rank 0 of each phase emits these to an :data:`EventSink`; the launcher adds
:class:`WorkerKilled`. All are small frozen dataclasses that pickle across processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseStarted:
    """The processes are up and the model is built; a :class:`Loaded` follows if ``resumes``."""

    phase: str
    label: str
    world_size: int
    end_step: int
    num_parameters: int
    resumes: bool


@dataclass(frozen=True)
class Loaded:
    """A checkpoint was loaded (``step`` is None when none was committed yet).

    ``digest`` is the :func:`~unickpt.demo.digest.state_digest` of the state after loading.
    """

    phase: str
    step: int | None
    load_s: float
    digest: str


@dataclass(frozen=True)
class StepDone:
    """``loss`` is the mean over the whole global batch, the same on every rank.

    On save steps (also in runs that do not save) ``digest`` is the state's digest after the
    step's update; otherwise it is None.
    """

    phase: str
    step: int
    loss: float
    digest: str | None = None


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
