"""Results of a benchmark run: per-rank measurements, per-system rows, the whole report.

Aggregation over ranks: times are the maximum over ranks (training waits for the slowest
rank), bytes are summed, and peak extra memory is the sum of each rank's peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

STATUS_OK = "ok"
STATUS_NOT_INSTALLED = "not installed"
STATUS_ERROR = "error"
STATUS_TIMEOUT = "timeout"


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured for one system. Times in seconds, sizes in bytes."""

    first_durable_s: float | None
    blocking_s: float
    step_wait_s: float
    iteration_slowdown_s: float
    durable_s: float
    save_write_bytes: int
    save_rchar: int
    save_peak_extra_bytes: int
    load_s: float | None
    load_rchar: int
    load_read_bytes: int
    load_peak_extra_bytes: int
    load_mismatches: int | None
    reshard_s: float | None
    reshard_rchar: int
    reshard_peak_extra_bytes: int
    reshard_mismatches: int | None
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class SystemResult:
    """One row of the report."""

    name: str
    label: str
    status: str
    message: str = ""
    notes: str = ""
    blocking_s: float | None = None
    step_wait_s: float | None = None
    iteration_slowdown_s: float | None = None
    durable_s: float | None = None
    first_durable_s: float | None = None
    load_s: float | None = None
    reshard_load_s: float | None = None
    bytes_written: int | None = None
    save_bytes_read: int | None = None
    load_bytes_read: int | None = None
    load_bytes_read_device: int | None = None
    reshard_bytes_read: int | None = None
    save_peak_extra_bytes: int | None = None
    load_peak_extra_bytes: int | None = None
    reshard_peak_extra_bytes: int | None = None
    load_verified: bool | None = None
    reshard_verified: bool | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SystemResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class HardwareResult:
    """What the machine can do with the same bytes and the same number of processes."""

    writers: int
    total_bytes: int
    write_fsync_s: float
    read_warm_s: float
    memcpy_bytes: int
    memcpy_s: float

    @property
    def write_bytes_per_s(self) -> float:
        return self.total_bytes / self.write_fsync_s

    @property
    def read_bytes_per_s(self) -> float:
        return self.total_bytes / self.read_warm_s

    @property
    def memcpy_bytes_per_s(self) -> float:
        return self.memcpy_bytes / self.memcpy_s

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["write_bytes_per_s"] = self.write_bytes_per_s
        data["read_bytes_per_s"] = self.read_bytes_per_s
        data["memcpy_bytes_per_s"] = self.memcpy_bytes_per_s
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


@dataclass(frozen=True)
class BenchReport:
    info: RunInfo
    hardware: HardwareResult | None
    systems: tuple[SystemResult, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "info": dataclasses.asdict(self.info),
            "hardware": None if self.hardware is None else self.hardware.to_dict(),
            "systems": [dataclasses.asdict(s) for s in self.systems],
        }


def combine(name: str, label: str, notes: str, ranks: list[RankMeasurement]) -> SystemResult:
    """Fold the measurements of every rank into one row (see the module docstring)."""
    errors = [e for r in ranks for e in r.errors]

    def tmax(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if len(known) == len(values) and known else None

    def verified(values: list[int | None]) -> bool | None:
        return None if any(v is None for v in values) else not any(values)

    return SystemResult(
        name=name,
        label=label,
        status=STATUS_OK,
        message="; ".join(dict.fromkeys(errors)),
        notes=notes,
        blocking_s=max(r.blocking_s for r in ranks),
        step_wait_s=max(r.step_wait_s for r in ranks),
        iteration_slowdown_s=max(r.iteration_slowdown_s for r in ranks),
        durable_s=max(r.durable_s for r in ranks),
        first_durable_s=tmax([r.first_durable_s for r in ranks]),
        load_s=tmax([r.load_s for r in ranks]),
        reshard_load_s=tmax([r.reshard_s for r in ranks]),
        bytes_written=sum(r.save_write_bytes for r in ranks),
        save_bytes_read=sum(r.save_rchar for r in ranks),
        load_bytes_read=sum(r.load_rchar for r in ranks),
        load_bytes_read_device=sum(r.load_read_bytes for r in ranks),
        reshard_bytes_read=sum(r.reshard_rchar for r in ranks),
        save_peak_extra_bytes=sum(r.save_peak_extra_bytes for r in ranks),
        load_peak_extra_bytes=sum(r.load_peak_extra_bytes for r in ranks),
        reshard_peak_extra_bytes=sum(r.reshard_peak_extra_bytes for r in ranks),
        load_verified=verified([r.load_mismatches for r in ranks]),
        reshard_verified=verified([r.reshard_mismatches for r in ranks]),
    )
