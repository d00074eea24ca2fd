"""Turn a :class:`BenchReport` into a markdown table, a JSON file and a PNG bar chart."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unickpt.bench.results import STATUS_OK, BenchReport, HardwareResult, SystemResult
from unickpt.bench.systems.registry import BASELINE_SYSTEM

log = logging.getLogger(__name__)

_MB = 1e6


@dataclass(frozen=True)
class Ratios:
    """One row's times divided by DCP's (lower is better) and by the hardware floor."""

    blocking_vs_dcp: float | None
    durable_vs_dcp: float | None
    load_vs_dcp: float | None
    reshard_vs_dcp: float | None
    durable_vs_hw: float | None
    load_vs_hw: float | None


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base <= 0:
        return None
    return value / base


def ratios(row: SystemResult, baseline: SystemResult | None, hw: HardwareResult | None) -> Ratios:
    ok = baseline is not None and baseline.status == STATUS_OK
    base = baseline if ok else None
    return Ratios(
        blocking_vs_dcp=_ratio(row.blocking_s, base.blocking_s if base else None),
        durable_vs_dcp=_ratio(row.durable_s, base.durable_s if base else None),
        load_vs_dcp=_ratio(row.load_s, base.load_s if base else None),
        reshard_vs_dcp=_ratio(row.reshard_load_s, base.reshard_load_s if base else None),
        durable_vs_hw=_ratio(row.durable_s, hw.write_fsync_s if hw else None),
        load_vs_hw=_ratio(row.load_s, hw.read_warm_s if hw else None),
    )


def _baseline(report: BenchReport) -> SystemResult | None:
    return next((s for s in report.systems if s.name == BASELINE_SYSTEM), None)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / _MB:,.0f}"


def _check(value: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[value]


_HEADER = (
    "| system | blocking (s) | durable (s) | load (s) | reshard load (s) | written (MB) "
    "| load read (MB) | reshard read (MB) | peak extra RSS save / load (MB) | verified "
    "| blocking vs DCP | durable vs DCP | load vs DCP | reshard vs DCP "
    "| durable vs HW | load vs HW |"
)


def _row(row: SystemResult, r: Ratios) -> str:
    if row.status != STATUS_OK:
        reason = row.status + (f": {row.message}" if row.message else "")
        return f"| {row.label} | {reason.replace('|', '/')} |" + " |" * 15
    peak = f"{_mb(row.save_peak_extra_bytes)} / {_mb(row.load_peak_extra_bytes)}"
    verified = f"{_check(row.load_verified)} / {_check(row.reshard_verified)}"
    cells = [
        row.label,
        _s(row.blocking_s),
        _s(row.durable_s),
        _s(row.load_s),
        _s(row.reshard_load_s),
        _mb(row.bytes_written),
        _mb(row.load_bytes_read),
        _mb(row.reshard_bytes_read),
        peak,
        verified,
        _x(r.blocking_vs_dcp),
        _x(r.durable_vs_dcp),
        _x(r.load_vs_dcp),
        _x(r.reshard_vs_dcp),
        _x(r.durable_vs_hw),
        _x(r.load_vs_hw),
    ]
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
        f"memcpy {hw.memcpy_bytes_per_s / _MB:,.0f} MB/s."
    ]


def to_markdown(report: BenchReport) -> str:
    """The report as markdown: setting, hardware line, one table row per system, notes."""
    info = report.info
    base = _baseline(report)
    lines = [
        f"`{info.command}`",
        "",
        f"{info.params / 1e6:.1f}M-parameter GPT ({info.model.get('n_layer')} layers, "
        f"d_model {info.model.get('d_model')}) + AdamW, FSDP2 over {info.world} ranks (gloo, CPU); "
        f"state {info.state_bytes / _MB:,.0f} MB in total; torch {info.torch_version}, "
        f"{info.cpu_count} CPUs; {info.started_at}.",
        "",
        *_hardware_lines(report.hardware),
        "",
        _HEADER,
        "|" + " --- |" * 16,
    ]
    lines += [_row(row, ratios(row, base, report.hardware)) for row in report.systems]
    lines += ["", "Notes:"]
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
    for row, entry in zip(report.systems, data["systems"]):
        entry["ratios"] = ratios(row, base, report.hardware).__dict__
    return data


RESULTS_START = "<!-- results:start -->"
RESULTS_END = "<!-- results:end -->"


def replace_results(document: str, markdown: str, image: str | None = None) -> str:
    """Put ``markdown`` (and a link to ``image``) between the results markers of a document."""
    start, end = document.find(RESULTS_START), document.find(RESULTS_END)
    if start < 0 or end < start:
        raise ValueError(f"the document has no {RESULTS_START} ... {RESULTS_END} block")
    body = markdown if image is None else f"{markdown}\n![checkpoint benchmark]({image})\n"
    return f"{document[: start + len(RESULTS_START)]}\n{body}{document[end:]}"


def write_outputs(report: BenchReport, out: Path) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.md`` and (when matplotlib is there) ``bench.png``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md"}
    paths["json"].write_text(json.dumps(to_json(report), indent=2) + "\n")
    paths["markdown"].write_text(to_markdown(report))
    chart = out / "bench.png"
    if write_chart(report, chart):
        paths["png"] = chart
    return paths


def write_chart(report: BenchReport, path: Path) -> bool:
    """Grouped bars of blocking, durable, load and reshard-load time; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; skipping %s (pip install matplotlib)", path)
        return False
    rows = [r for r in report.systems if r.status == STATUS_OK]
    metrics = [
        ("blocking", "blocking_s"),
        ("durable", "durable_s"),
        ("load", "load_s"),
        ("reshard load", "reshard_load_s"),
    ]
    width = 0.8 / len(metrics)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(rows) + 2), 5))
    for i, (label, attr) in enumerate(metrics):
        values = [getattr(r, attr) or 0.0 for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=label)
    hw = report.hardware
    if hw is not None:
        ax.axhline(
            hw.write_fsync_s, color="grey", linestyle="--", linewidth=1, label="HW write+fsync"
        )
        ax.axhline(hw.read_warm_s, color="grey", linestyle=":", linewidth=1, label="HW read (warm)")
    ax.set_xticks([x + 1.5 * width for x in range(len(rows))])
    ax.set_xticklabels([r.label for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("seconds (lower is better)")
    ax.set_title(
        f"Checkpoint of {report.info.params / 1e6:.0f}M params + AdamW, "
        f"{report.info.world} ranks ({report.info.state_bytes / _MB:,.0f} MB)"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
