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
    """One save; ``committed`` is also set when its phase died before reporting it, but a
    later phase loaded it (``durable_s`` then stays None)."""

    step: int
    blocking_s: float
    durable_s: float | None = None
    size_bytes: int | None = None
    committed: bool = False


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
    loaded_digest: str | None = None
    losses: dict[int, float] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)
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
            if event.digest is not None:
                record.digests[event.step] = event.digest
        elif isinstance(event, SaveStarted):
            record.saves[event.step] = SaveRecord(event.step, event.blocking_s)
        elif isinstance(event, SaveDurable):
            save = record.saves[event.step]
            save.durable_s, save.size_bytes, save.committed = (
                event.durable_s,
                event.size_bytes,
                True,
            )
        elif isinstance(event, Loaded):
            record.resumed_from, record.load_s = event.step, event.load_s
            record.loaded_digest = event.digest
            self._mark_committed(event.step)
        elif isinstance(event, WorkerKilled):
            record.killed = event
        elif isinstance(event, PhaseFinished):
            record.elapsed_s = event.elapsed_s

    def _mark_committed(self, step: int | None) -> None:
        """The newest earlier save of ``step`` is the one that was loaded."""
        for record in reversed(list(self.phases.values())):
            if step in record.saves:
                record.saves[step].committed = True
                return


@dataclass(frozen=True)
class Comparison:
    """How one phase compares with the reference run, step by step.

    ``resumed``: the phase looked for a checkpoint (``resumed_from`` is None when none was
    committed yet). ``restored_exactly``: the state after loading has the digest the state had
    when it was saved (None when nothing was loaded). ``started_as_reference``: the phase
    started from the reference's state at that step, bit for bit. ``states_as_reference``: at
    every save step the state equals the reference's (None when the phase reached none).
    ``expected`` is ``"bitwise"`` when the phase started as the reference and runs at its world
    size; ``"tolerance"`` otherwise, since sums then may run in another order.
    """

    phase: str
    label: str
    world_size: int
    first_step: int
    last_step: int
    resumed: bool
    resumed_from: int | None
    restored_exactly: bool | None
    started_as_reference: bool
    states_as_reference: bool | None
    expected: str
    max_abs_diff: float
    bitwise: bool
    tolerance: float

    @property
    def matches(self) -> bool:
        if self.restored_exactly is False:
            return False
        if self.expected == "bitwise":
            return self.bitwise and self.states_as_reference is not False
        return self.max_abs_diff <= self.tolerance


def compare_with_reference(
    phases: list[PhaseRecord], reference: PhaseRecord, tolerance: float
) -> list[Comparison]:
    """One comparison per phase that ran steps, in order; ``reference`` itself is skipped."""
    comparisons = []
    saved: dict[int, str] = {}  # the digest of each step when it was last saved
    for record in phases:
        if record is reference or not record.losses:
            continue
        comparisons.append(_compare(record, reference, saved, tolerance))
        if record.saves:
            saved.update({s: d for s, d in record.digests.items() if s in record.saves})
    return comparisons


def _compare(
    record: PhaseRecord, reference: PhaseRecord, saved: dict[int, str], tolerance: float
) -> Comparison:
    steps = sorted(record.losses)
    diffs = [abs(record.losses[s] - reference.losses[s]) for s in steps]
    start = record.resumed_from
    restored = None if start is None else record.loaded_digest == saved.get(start)
    as_reference = start is None or record.loaded_digest == reference.digests.get(start)
    same_world = record.world_size == reference.world_size
    states = [record.digests[s] == reference.digests.get(s) for s in record.digests]
    return Comparison(
        phase=record.name,
        label=record.label,
        world_size=record.world_size,
        first_step=steps[0],
        last_step=steps[-1],
        resumed=record.load_s is not None,
        resumed_from=start,
        restored_exactly=restored,
        started_as_reference=as_reference,
        states_as_reference=all(states) if states else None,
        expected="bitwise" if as_reference and same_world else "tolerance",
        max_abs_diff=max(diffs),
        bitwise=all(record.losses[s] == reference.losses[s] for s in steps),
        tolerance=tolerance,
    )


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
