"""Collecting the events of a demo run and comparing each phase's losses with the reference."""

from __future__ import annotations

from dataclasses import dataclass, field

from unickpt.demo.config import DemoConfig
from unickpt.demo.events import (
    Event,
    Loaded,
    PhaseFinished,
    PhaseStarted,
    SaveDurable,
    SaveStarted,
    StepDone,
    WorkerKilled,
)


@dataclass
class SaveRecord:
    step: int
    blocking_s: float
    durable_s: float | None = None
    size_bytes: int | None = None


@dataclass
class PhaseRecord:
    """What one phase did, as its events told it."""

    name: str
    label: str
    world_size: int
    end_step: int
    num_parameters: int
    resumed_from: int | None = None
    load_s: float | None = None
    losses: dict[int, float] = field(default_factory=dict)
    saves: dict[int, SaveRecord] = field(default_factory=dict)
    killed: WorkerKilled | None = None
    elapsed_s: float | None = None


class Recorder:
    """An event sink that keeps every phase's record, in the order the phases started."""

    def __init__(self) -> None:
        self.phases: dict[str, PhaseRecord] = {}

    def __call__(self, event: Event) -> None:
        if isinstance(event, PhaseStarted):
            self.phases[event.phase] = PhaseRecord(
                event.phase, event.label, event.world_size, event.end_step, event.num_parameters
            )
            return
        record = self.phases[event.phase]
        if isinstance(event, StepDone):
            record.losses[event.step] = event.loss
        elif isinstance(event, SaveStarted):
            record.saves[event.step] = SaveRecord(event.step, event.blocking_s)
        elif isinstance(event, SaveDurable):
            record.saves[event.step].durable_s = event.durable_s
            record.saves[event.step].size_bytes = event.size_bytes
        elif isinstance(event, Loaded):
            record.resumed_from, record.load_s = event.step, event.load_s
        elif isinstance(event, WorkerKilled):
            record.killed = event
        elif isinstance(event, PhaseFinished):
            record.elapsed_s = event.elapsed_s


@dataclass(frozen=True)
class Comparison:
    """How a phase's per-step losses compare with the reference run's at the same steps.

    ``expected`` is ``"bitwise"`` when every phase that trained the loaded state ran at the
    reference's world size, and ``"tolerance"`` otherwise (floating-point sums then run in
    another order).
    """

    phase: str
    label: str
    first_step: int
    last_step: int
    expected: str
    max_abs_diff: float
    bitwise: bool
    tolerance: float

    @property
    def matches(self) -> bool:
        return self.bitwise if self.expected == "bitwise" else self.max_abs_diff <= self.tolerance


def compare_with_reference(
    phases: list[PhaseRecord], reference: PhaseRecord, tolerance: float
) -> list[Comparison]:
    """One comparison per phase after the reference, in order."""
    comparisons = []
    lineage_world_sizes: set[int] = set()
    for record in phases:
        if record is reference or not record.losses:
            continue
        lineage_world_sizes.add(record.world_size)
        steps = sorted(record.losses)
        diffs = [abs(record.losses[s] - reference.losses[s]) for s in steps]
        same_lineage = lineage_world_sizes == {reference.world_size}
        comparisons.append(
            Comparison(
                phase=record.name,
                label=record.label,
                first_step=steps[0],
                last_step=steps[-1],
                expected="bitwise" if same_lineage else "tolerance",
                max_abs_diff=max(diffs),
                bitwise=all(record.losses[s] == reference.losses[s] for s in steps),
                tolerance=tolerance,
            )
        )
    return comparisons


@dataclass(frozen=True)
class DemoResult:
    """The outcome of :func:`~unickpt.demo.scenario.run_demo`."""

    config: DemoConfig
    phases: list[PhaseRecord]
    comparisons: list[Comparison]
    summary_path: str
    chart_path: str | None
    elapsed_s: float

    @property
    def all_match(self) -> bool:
        return all(c.matches for c in self.comparisons)
