"""Results of a benchmark: what a rank measured, one run of a system, one row, the report.

Ranks fold into a run as each measure says (:mod:`unickpt.bench.measures`: times take the
slowest rank, bytes and memory are summed). Runs fold into a row: each figure is the median of
the runs, with the lowest and highest run beside it.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from unickpt.bench.measures import measure

STATUS_OK = "ok"
STATUS_NOT_INSTALLED = "not installed"
STATUS_ERROR = "error"
STATUS_TIMEOUT = "timeout"
STATUS_SKIPPED = "skipped"

#: The loads whose restored state is checked, in the order the runner does them.
PHASES: tuple[str, ...] = ("load", "reshard load")


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured for one system in one run.

    ``values``: figures keyed by measure (times in seconds, sizes in bytes). ``mismatches``:
    per checked load, the number of tensors whose digest differs from the saved state's, or
    None when that load failed.
    """

    values: dict[str, float]
    mismatches: dict[str, int | None]
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunResult:
    """One run of one system, every rank folded in."""

    values: dict[str, float]
    verified: dict[str, bool | None]
    message: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        return cls(dict(data["values"]), dict(data["verified"]), data.get("message", ""))


def combine(ranks: list[RankMeasurement]) -> RunResult:
    """Fold the measurements of every rank into one run; a value some rank lacks is dropped."""
    keys = set.intersection(*(set(r.values) for r in ranks)) if ranks else set()
    values: dict[str, float] = {}
    for key in sorted(keys):
        per_rank = [r.values[key] for r in ranks]
        values[key] = sum(per_rank) if measure(key).fold == "sum" else max(per_rank)
    verified: dict[str, bool | None] = {}
    for phase in PHASES:
        counts = [r.mismatches.get(phase) for r in ranks]
        verified[phase] = None if any(c is None for c in counts) else not any(counts)
    errors = [e for r in ranks for e in r.errors]
    return RunResult(values, verified, "; ".join(dict.fromkeys(errors)))


@dataclass(frozen=True)
class Figure:
    """A measure over the runs of one system: median, lowest, highest, and every run's value."""

    median: float
    low: float
    high: float
    runs: tuple[float, ...]

    @classmethod
    def of(cls, values: list[float]) -> Figure:
        return cls(statistics.median(values), min(values), max(values), tuple(values))


@dataclass(frozen=True)
class SystemResult:
    """One row of the report: a system over all its runs.

    ``runs`` counts the runs that produced figures; ``failed_runs`` those that did not.
    ``verified`` per checked load: True when every run restored every element, False when
    one did not, None when no run got that far.
    """

    name: str
    label: str
    status: str
    message: str = ""
    notes: str = ""
    runs: int = 0
    failed_runs: int = 0
    figures: dict[str, Figure] = field(default_factory=dict)
    verified: dict[str, bool | None] = field(default_factory=dict)

    def median(self, key: str) -> float | None:
        figure = self.figures.get(key)
        return None if figure is None else figure.median

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SystemResult:
        data = dict(data)
        data["figures"] = {
            k: Figure(v["median"], v["low"], v["high"], tuple(v["runs"]))
            for k, v in data.get("figures", {}).items()
        }
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def summarize(
    name: str,
    label: str,
    notes: str,
    runs: list[RunResult],
    failures: list[tuple[str, str]],
) -> SystemResult:
    """Fold a system's runs into its row. ``failures`` are (status, message) of runs that
    produced nothing (a crash, a hang, a library that failed to start)."""
    if not runs:
        status, message = failures[0] if failures else (STATUS_ERROR, "no run finished")
        return SystemResult(name, label, status, message, notes, 0, len(failures))
    keys = sorted(set().union(*(r.values for r in runs)))
    figures = {k: Figure.of([r.values[k] for r in runs if k in r.values]) for k in keys}
    verified: dict[str, bool | None] = {}
    for phase in PHASES:
        checks = [r.verified.get(phase) for r in runs]
        verified[phase] = False if False in checks else (None if None in checks else True)
    messages = [r.message for r in runs if r.message]
    if failures:
        messages.insert(
            0,
            f"{len(failures)} of {len(runs) + len(failures)} runs failed: "
            f"{failures[0][0]}: {failures[0][1]}",
        )
    message = "; ".join(dict.fromkeys(messages))
    return SystemResult(
        name, label, STATUS_OK, message, notes, len(runs), len(failures), figures, verified
    )


@dataclass(frozen=True)
class HardwareResult:
    """What the machine can do with the same bytes and the same number of processes."""

    writers: int
    total_bytes: int
    write_fsync_s: float
    read_warm_s: float
    memcpy_bytes: int
    memcpy_s: float
    device_copy_bytes: int = 0  # 0: the state was not on a GPU, no device copies measured
    d2h_s: float = 0.0  # GPU to pinned host memory
    h2d_s: float = 0.0  # pinned host memory to GPU

    @property
    def write_bytes_per_s(self) -> float:
        return self.total_bytes / self.write_fsync_s

    @property
    def read_bytes_per_s(self) -> float:
        return self.total_bytes / self.read_warm_s

    @property
    def memcpy_bytes_per_s(self) -> float:
        return self.memcpy_bytes / self.memcpy_s

    @property
    def d2h_bytes_per_s(self) -> float | None:
        return self.device_copy_bytes / self.d2h_s if self.device_copy_bytes else None

    @property
    def h2d_bytes_per_s(self) -> float | None:
        return self.device_copy_bytes / self.h2d_s if self.device_copy_bytes else None

    def limit_s(self, which: str) -> float:
        """The time of the machine's ``"write"`` (with fsync) or ``"read"`` of the state."""
        return self.write_fsync_s if which == "write" else self.read_warm_s

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["write_bytes_per_s"] = self.write_bytes_per_s
        data["read_bytes_per_s"] = self.read_bytes_per_s
        data["memcpy_bytes_per_s"] = self.memcpy_bytes_per_s
        data["d2h_bytes_per_s"] = self.d2h_bytes_per_s
        data["h2d_bytes_per_s"] = self.h2d_bytes_per_s
        return data


@dataclass(frozen=True)
class RunInfo:
    """The setting a report was measured in."""

    command: str
    params: int
    model: dict[str, int]
    world: int
    state_bytes: int
    torch_version: str
    python_version: str
    cpu_count: int
    machine: str
    started_at: str
    seconds: float = 0.0
    repeats: int = 1
    device: str = "cpu"
    gpu_available: bool = False  # torch.cuda.is_available() on the machine that ran it


@dataclass(frozen=True)
class BenchReport:
    info: RunInfo
    hardware: HardwareResult | None
    systems: tuple[SystemResult, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "info": dataclasses.asdict(self.info),
            "hardware": None if self.hardware is None else self.hardware.to_dict(),
            "systems": [s.to_dict() for s in self.systems],
        }
