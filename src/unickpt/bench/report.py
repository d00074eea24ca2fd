"""Turn a :class:`BenchReport` into a markdown table, a JSON file and one PNG chart per measure.

Columns and charts come from :mod:`unickpt.bench.measures`. A cell is the median of the runs
with the lowest and highest run in brackets (``0.39 (0.37-0.44)``); ratios divide medians.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unickpt.bench.measures import CHARTS, MEASURES, Chart, Measure, measure
from unickpt.bench.results import (
    PHASES,
    STATUS_OK,
    BenchReport,
    Figure,
    HardwareResult,
    RunInfo,
    SystemResult,
)
from unickpt.bench.systems.registry import BASELINE_SYSTEM, SYSTEMS_BY_NAME

log = logging.getLogger(__name__)

_MB = 1e6
#: Runs per system below which a report says its figures are not to be quoted.
MIN_REPEATS = 3


@dataclass(frozen=True)
class Ratio:
    """A column of ratios: one measure's median over the baseline's or the hardware's time."""

    key: str
    against: str  # "baseline" or "hardware"

    def label(self, baseline_label: str) -> str:
        m = measure(self.key)
        return f"{m.short} vs {baseline_label if self.against == 'baseline' else 'HW'}"


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base <= 0:
        return None
    return value / base


def ratio_value(
    ratio: Ratio, row: SystemResult, baseline: SystemResult | None, hw: HardwareResult | None
) -> float | None:
    m = measure(ratio.key)
    if ratio.against == "hardware":
        return _ratio(row.median(m.key), hw.limit_s(m.hardware) if hw and m.hardware else None)
    ok = baseline is not None and baseline.status == STATUS_OK
    return _ratio(row.median(m.key), baseline.median(m.key) if ok and baseline else None)


def _baseline(report: BenchReport) -> SystemResult | None:
    return next((s for s in report.systems if s.name == BASELINE_SYSTEM), None)


def _present(report: BenchReport, keys: list[str]) -> list[str]:
    """The keys some row has a figure for, in the given order."""
    return [k for k in keys if any(k in row.figures for row in report.systems)]


def table_measures(report: BenchReport) -> list[Measure]:
    return [measure(k) for k in _present(report, [m.key for m in MEASURES if m.in_table])]


def ratio_columns(report: BenchReport) -> list[Ratio]:
    shown = table_measures(report)
    columns = [Ratio(m.key, "baseline") for m in shown if m.vs_baseline]
    return columns + [Ratio(m.key, "hardware") for m in shown if m.hardware]


def _number(m: Measure, value: float) -> str:
    return f"{value:.3f}" if m.unit == "s" else f"{value / _MB:,.0f}"


def cell(m: Measure, figure: Figure | None) -> str:
    """``median (min-max)``, or the median alone when every run gave the same printed value;
    ``min to max`` when the lowest is negative (a stall within the noise of the iterations)."""
    if figure is None:
        return "-"
    median, low, high = (_number(m, v) for v in (figure.median, figure.low, figure.high))
    if low == high:
        return median
    return f"{median} ({low} to {high})" if figure.low < 0 else f"{median} ({low}-{high})"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _check(value: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[value]


def _row(
    row: SystemResult,
    shown: list[Measure],
    ratios: list[Ratio],
    baseline: SystemResult | None,
    hw: HardwareResult | None,
) -> str:
    width = len(shown) + len(ratios) + 1
    if row.status != STATUS_OK:
        reason = row.status + (f": {row.message}" if row.message else "")
        return f"| {row.label} | {reason.replace('|', '/')} |" + " |" * (width - 1)
    cells = [row.label]
    cells += [cell(m, row.figures.get(m.key)) for m in shown]
    cells.append(" / ".join(_check(row.verified.get(p)) for p in PHASES))
    cells += [_x(ratio_value(r, row, baseline, hw)) for r in ratios]
    return "| " + " | ".join(cells) + " |"


def _hardware_lines(hw: HardwareResult | None) -> list[str]:
    if hw is None:
        return ["Hardware limits: not measured."]
    return [
        f"Hardware, same run ({hw.writers} processes, {hw.total_bytes / _MB:,.0f} MB): "
        f"sequential write + fsync {hw.write_fsync_s:.3f} s "
        f"({hw.write_bytes_per_s / _MB:,.0f} MB/s); "
        f"sequential read, page cache warm {hw.read_warm_s:.3f} s "
        f"({hw.read_bytes_per_s / _MB:,.0f} MB/s); "
        f"memcpy {hw.memcpy_bytes_per_s / _MB:,.0f} MB/s" + _device_copy_text(hw) + "."
    ]


def _device_copy_text(hw: HardwareResult) -> str:
    d2h, h2d = hw.d2h_bytes_per_s, hw.h2d_bytes_per_s
    if d2h is None or h2d is None:
        return ""
    return (
        f"; GPU to pinned host {d2h / _MB:,.0f} MB/s, pinned host to GPU {h2d / _MB:,.0f} MB/s "
        f"({hw.device_copy_bytes / _MB:,.0f} MB, every process at once)"
    )


def _setting(report: BenchReport) -> str:
    info = report.info
    where = "CUDA, one GPU per rank, NCCL + gloo" if info.device == "cuda" else "gloo, CPU"
    fewest = _fewest_runs(report)
    return (
        f"{info.params / 1e6:.1f}M-parameter GPT ({info.model.get('n_layer')} layers, "
        f"d_model {info.model.get('d_model')}) + AdamW, FSDP2 over {info.world} ranks ({where}); "
        f"state {info.state_bytes / _MB:,.0f} MB in total; torch {info.torch_version}, "
        f"{info.cpu_count} CPUs; {info.started_at}. Each figure: median of {_runs_text(report)} "
        "per system (lowest-highest in brackets), systems alternating, every run in fresh "
        "processes; ratios divide medians."
        + (
            ""
            if fewest >= MIN_REPEATS
            else f" Fewer than {MIN_REPEATS} runs: a check of the harness, not figures to quote."
        )
    )


def _fewest_runs(report: BenchReport) -> int:
    """The fewest runs a measured row has (the planned repeats when no row was measured)."""
    done = [row.runs for row in report.systems if row.status == STATUS_OK]
    return min([*done, report.info.repeats])


def _runs_text(report: BenchReport) -> str:
    """ "3 runs", or "1-2 runs (3 planned)" when some runs did not finish."""
    planned = report.info.repeats
    done = [row.runs for row in report.systems if row.status == STATUS_OK] or [planned]
    low, high = min(done), max(done)
    if low >= planned:
        return f"{planned} run{'s' if planned != 1 else ''}"
    span = f"{low}" if low == high else f"{low}-{high}"
    return f"{span} run{'s' if high != 1 else ''} ({planned} planned)"


def gpu_line(info: RunInfo) -> str:
    """What the report says about GPU figures."""
    if info.device == "cuda":
        return "State on CUDA devices: GPU figures."
    if info.gpu_available:
        return "GPU figures are not in this report: it ran on CPU (`--device cuda` measures them)."
    return "GPU figures are missing: no GPU was available on the machine of this run."


def to_markdown(report: BenchReport) -> str:
    """The report as markdown: setting, hardware line, one table row per system, notes."""
    base = _baseline(report)
    base_label = "DCP" if BASELINE_SYSTEM == "dcp" else SYSTEMS_BY_NAME[BASELINE_SYSTEM].label
    shown = table_measures(report)
    ratios = ratio_columns(report)
    header = [m.label for m in shown] + ["verified"] + [r.label(base_label) for r in ratios]
    lines = [
        f"`{report.info.command}`",
        "",
        _setting(report),
        "",
        gpu_line(report.info),
        "",
        *_hardware_lines(report.hardware),
        "",
        "| system | " + " | ".join(header) + " |",
        "| --- |" + " --- |" * len(header),
    ]
    lines += [_row(row, shown, ratios, base, report.hardware) for row in report.systems]
    lines += ["", "Settings of each system in this run (best settings for the machine):"]
    lines += [f"- {row.label}: {row.notes}" for row in report.systems if row.notes]
    lines += [
        f"- {row.label}: {row.message}"
        for row in report.systems
        if row.status == STATUS_OK and row.message
    ]
    return "\n".join(lines) + "\n"


def to_json(report: BenchReport) -> dict[str, Any]:
    data = report.to_dict()
    base = _baseline(report)
    columns = [Ratio(m.key, "baseline") for m in MEASURES if m.vs_baseline]
    columns += [Ratio(m.key, "hardware") for m in MEASURES if m.hardware]
    for row, entry in zip(report.systems, data["systems"]):
        entry["ratios"] = {
            f"{r.key}_vs_{r.against}": ratio_value(r, row, base, report.hardware) for r in columns
        }
    return data


RESULTS_START = "<!-- results:start -->"
RESULTS_END = "<!-- results:end -->"


def replace_results(document: str, markdown: str, images: list[str] | None = None) -> str:
    """Put ``markdown`` (and links to ``images``) between the results markers of a document."""
    start, end = document.find(RESULTS_START), document.find(RESULTS_END)
    if start < 0 or end < start:
        raise ValueError(f"the document has no {RESULTS_START} ... {RESULTS_END} block")
    links = "".join(f"\n![{Path(i).stem}]({i})\n" for i in images or [])
    return f"{document[: start + len(RESULTS_START)]}\n{markdown}{links}{document[end:]}"


def write_outputs(report: BenchReport, out: Path) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.md`` and (with matplotlib) ``bench-<chart>.png`` files."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md"}
    paths["json"].write_text(json.dumps(to_json(report), indent=2) + "\n")
    paths["markdown"].write_text(to_markdown(report))
    for chart in CHARTS:
        path = out / f"bench-{chart.name}.png"
        if write_chart(report, chart, path):
            paths[f"png:{chart.name}"] = path
    return paths


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_chart(report: BenchReport, chart: Chart, path: Path) -> bool:
    """Bars per system for each measure of ``chart``, error bars from the lowest to the highest
    run; False when no row has these measures or matplotlib is missing."""
    rows = [r for r in report.systems if r.status == STATUS_OK]
    keys = [k for k in chart.measures if any(k in r.figures for r in rows)]
    if not keys:
        return False
    plt = _pyplot()
    if plt is None:
        log.warning("matplotlib is not installed; skipping %s (pip install matplotlib)", path)
        return False
    scale = 1.0 if measure(keys[0]).unit == "s" else 1 / _MB
    width = 0.8 / len(keys)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(rows) + 2), 4.5))
    for i, key in enumerate(keys):
        figures = [r.figures.get(key) for r in rows]
        medians = [f.median * scale if f else 0.0 for f in figures]
        below = [(f.median - f.low) * scale if f else 0.0 for f in figures]
        above = [(f.high - f.median) * scale if f else 0.0 for f in figures]
        xs = [x + (i - (len(keys) - 1) / 2) * width for x in range(len(rows))]
        ax.bar(xs, medians, width, yerr=[below, above], capsize=3, label=measure(key).short)
        for x, f in zip(xs, figures):
            if f is None:  # no bar of height 0 that would read as the best: say it is missing
                ax.annotate("n/a", (x, 0), ha="center", va="bottom", fontsize=7, color="grey")
    hw = report.hardware
    if chart.hardware and hw is not None:
        what = "write + fsync" if chart.hardware == "write" else "read (warm)"
        ax.axhline(
            hw.limit_s(chart.hardware),
            color="grey",
            linestyle="--",
            linewidth=1,
            label=f"hardware {what}",
        )
    ax.set_xticks(list(range(len(rows))))
    ax.set_xticklabels([r.label for r in rows], rotation=30, ha="right", fontsize=8)
    unit = "seconds" if scale == 1.0 else "MB"
    ax.set_ylabel(f"{unit} (lower is better)")
    info = report.info
    ax.set_title(
        f"{chart.title}\n{info.params / 1e6:.0f}M params + AdamW, {info.world} ranks "
        f"({info.state_bytes / _MB:,.0f} MB), median of {info.repeats}, bars: min-max",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
