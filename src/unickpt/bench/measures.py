"""Every figure the benchmark reports, declared once: its column, its unit, how ranks fold.

Adding a measure:

1. add a :class:`Measure` to :data:`MEASURES` (its key, its column label, its unit, and
   whether ranks fold by ``max`` (times: training waits for the slowest rank) or ``sum``
   (bytes, memory));
2. put a value under that key in the rank's values: in the runner for a measure of every
   system, or in :meth:`CheckpointSystem.extra_measures` for one that only some systems have;
3. to chart it, name it in a :class:`Chart` of :data:`CHARTS`.

Every figure is the median of the runs, with their min and max; a column appears as soon as
one row has the measure, and rows without it read ``-``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Unit = Literal["s", "bytes"]
Fold = Literal["max", "sum"]
HardwareLimit = Literal["write", "read"]


@dataclass(frozen=True)
class Measure:
    """One figure of a run.

    ``in_table``: shown as a column of the markdown table (every measure is in the JSON).
    ``vs_baseline``: a ratio column against the baseline system's median (DCP's save).
    ``hardware``: a ratio column against the machine's write+fsync or read time.
    """

    key: str
    label: str
    unit: Unit
    fold: Fold
    in_table: bool = True
    vs_baseline: bool = False
    hardware: HardwareLimit | None = None
    ratio_label: str = ""

    @property
    def short(self) -> str:
        """The label without its unit, for ratio columns and chart legends."""
        return self.ratio_label or self.label.split(" (")[0]


MEASURES: tuple[Measure, ...] = (
    Measure("blocking_s", "blocking (s)", "s", "max", vs_baseline=True),
    Measure("stall_s", "stall (s)", "s", "max", vs_baseline=True),
    Measure("step_wait_s", "step wait (s)", "s", "max", in_table=False),
    Measure("durable_s", "durable (s)", "s", "max", vs_baseline=True, hardware="write"),
    Measure("first_durable_s", "first save durable (s)", "s", "max", in_table=False),
    Measure("load_s", "load (s)", "s", "max", vs_baseline=True, hardware="read"),
    Measure(
        "reshard_load_s", "reshard load (s)", "s", "max", vs_baseline=True, ratio_label="reshard"
    ),
    Measure("bytes_written", "written (MB)", "bytes", "sum"),
    Measure("save_bytes_read", "save read (MB)", "bytes", "sum", in_table=False),
    Measure("load_bytes_read", "load read (MB)", "bytes", "sum"),
    Measure("load_bytes_read_device", "load read from device (MB)", "bytes", "sum", in_table=False),
    Measure("reshard_bytes_read", "reshard read (MB)", "bytes", "sum"),
    Measure("reshard_bytes_reported", "reshard read, own count (MB)", "bytes", "sum"),
    Measure("save_peak_extra_bytes", "peak extra RSS save (MB)", "bytes", "sum"),
    Measure("load_peak_extra_bytes", "peak extra RSS load (MB)", "bytes", "sum"),
    Measure(
        "reshard_peak_extra_bytes", "peak extra RSS reshard (MB)", "bytes", "sum", in_table=False
    ),
    Measure("save_peak_gpu_bytes", "peak extra GPU save (MB)", "bytes", "sum"),
)

MEASURES_BY_KEY: dict[str, Measure] = {m.key: m for m in MEASURES}


@dataclass(frozen=True)
class Chart:
    """One PNG (``bench-<name>.png``): a bar per system and measure, error bars from min/max,
    and the machine's limit as a line when ``hardware`` is set."""

    name: str
    title: str
    measures: tuple[str, ...]
    hardware: HardwareLimit | None = None


CHARTS: tuple[Chart, ...] = (
    Chart("stall", "Training stall per checkpoint", ("blocking_s", "stall_s")),
    Chart("durable", "Save until durable (fsynced, committed)", ("durable_s",), "write"),
    Chart("load", "Load into the saved layout", ("load_s",), "read"),
    Chart("reshard-load", "Load into another layout", ("reshard_load_s",)),
    Chart(
        "memory",
        "Peak extra resident memory",
        ("save_peak_extra_bytes", "load_peak_extra_bytes", "reshard_peak_extra_bytes"),
    ),
    Chart("gpu-memory", "Peak extra GPU memory of a save", ("save_peak_gpu_bytes",)),
)


def measure(key: str) -> Measure:
    """The declared measure ``key``; a value under an undeclared key is an error to fix here."""
    try:
        return MEASURES_BY_KEY[key]
    except KeyError:
        raise KeyError(
            f"measure {key!r} is not declared; add it to MEASURES in unickpt/bench/measures.py"
        ) from None
