"""The report: cells with the range of the runs, ratios of medians, one chart per measure, and
the results block of a document."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from unickpt.bench.measures import CHARTS, measure
from unickpt.bench.report import cell, gpu_line, replace_results, to_markdown, write_outputs
from unickpt.bench.results import (
    STATUS_NOT_INSTALLED,
    BenchReport,
    Figure,
    HardwareResult,
    RunInfo,
    RunResult,
    SystemResult,
    summarize,
)

_INFO = RunInfo(
    "unickpt bench --repeats 3",
    20_000_000,
    {"n_layer": 6, "d_model": 384},
    2,
    220_000_000,
    "2.13.0",
    "3.11",
    2,
    "x86_64",
    "now",
    1.0,
    3,
    "cpu",
)
_HW = HardwareResult(2, 220_000_000, 0.5, 0.05, 1 << 29, 0.1)


def _row(name: str, label: str, durable: list[float], extra: dict[str, float]) -> SystemResult:
    runs = [
        RunResult({"durable_s": d, "stall_s": d / 2, **extra}, {"load": True, "reshard load": True})
        for d in durable
    ]
    return summarize(name, label, f"{label} settings", runs, [])


def _report() -> BenchReport:
    rows = (
        _row("unickpt", "unickpt save", [0.39, 0.37, 0.44], {"save_peak_extra_bytes": 3e6}),
        _row("dcp", "DCP save", [0.78, 0.80, 0.70], {"save_peak_extra_bytes": 5e7}),
        SystemResult("torchsnapshot", "torchsnapshot 0.1.0", STATUS_NOT_INSTALLED, "no env"),
    )
    return BenchReport(_INFO, _HW, rows)


def test_cell_shows_median_and_range() -> None:
    seconds, mb = measure("durable_s"), measure("bytes_written")
    assert cell(seconds, Figure(0.39, 0.37, 0.44, ())) == "0.390 (0.370-0.440)"
    assert cell(mb, Figure(1.3e9, 1.3e9, 1.3e9, ())) == "1,300"
    assert cell(mb, None) == "-"
    assert cell(seconds, Figure(0.01, -0.02, 0.03, ())) == "0.010 (-0.020 to 0.030)"


def test_markdown_table() -> None:
    text = to_markdown(_report())
    header = next(line for line in text.splitlines() if line.startswith("| system"))
    assert "| durable (s) |" in header and "| stall (s) |" in header
    assert "| durable vs DCP |" in header and "| durable vs HW |" in header
    assert "load (s)" not in header  # no row has it
    unickpt_row = next(line for line in text.splitlines() if line.startswith("| unickpt save"))
    assert "| 0.390 (0.370-0.440) | " in unickpt_row
    assert "| 0.50x |" in unickpt_row  # 0.39 / 0.78: medians, not means or best runs
    assert "| 0.78x |" in unickpt_row  # durable vs HW: 0.39 / 0.5
    assert "| yes / yes |" in unickpt_row
    assert "| torchsnapshot 0.1.0 | not installed: no env |" in text
    assert "median of 3 runs" in text and "not figures to quote" not in text
    one_run = BenchReport(dataclasses.replace(_INFO, repeats=1), _HW, _report().systems)
    assert "median of 1 run per system" in to_markdown(one_run)
    assert "Fewer than 3 runs: a check of the harness" in to_markdown(one_run)
    assert "GPU figures are missing: no GPU was available" in text
    assert "- DCP save: DCP save settings" in text  # each system's settings, by its label


def test_gpu_line() -> None:
    assert "--device cuda" in gpu_line(dataclasses.replace(_INFO, gpu_available=True))
    assert gpu_line(dataclasses.replace(_INFO, device="cuda")).startswith("State on CUDA")


def test_outputs_one_chart_per_measure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    paths = write_outputs(_report(), tmp_path)
    data = json.loads(paths["json"].read_text())
    unickpt_row = data["systems"][0]
    assert unickpt_row["figures"]["durable_s"]["runs"] == [0.39, 0.37, 0.44]
    assert unickpt_row["ratios"]["durable_s_vs_baseline"] == pytest.approx(0.39 / 0.78)
    charts = {k.removeprefix("png:") for k in paths if k.startswith("png:")}
    assert charts == {"stall", "durable", "memory"}  # charts whose measures some row has
    assert {c.name for c in CHARTS} >= charts
    for name in charts:
        assert (tmp_path / f"bench-{name}.png").stat().st_size > 0


def test_replace_results_block() -> None:
    doc = "# Title\n\n<!-- results:start -->\nold\n<!-- results:end -->\n\nrest\n"
    new = replace_results(doc, "| a |\n", ["benchmarks-stall.png", "benchmarks-load.png"])
    assert "old" not in new
    assert "| a |" in new and "![benchmarks-stall](benchmarks-stall.png)" in new
    assert "![benchmarks-load](benchmarks-load.png)" in new
    assert new.endswith("<!-- results:end -->\n\nrest\n")
    with pytest.raises(ValueError, match="results"):
        replace_results("no block", "x")


def test_hardware_line_shows_device_copies_only_when_measured() -> None:
    assert "pinned host" not in to_markdown(_report())
    hw = dataclasses.replace(_HW, device_copy_bytes=100_000_000, d2h_s=0.01, h2d_s=0.02)
    markdown = to_markdown(BenchReport(_INFO, hw, _report().systems))
    assert "GPU to pinned host 10,000 MB/s, pinned host to GPU 5,000 MB/s (100 MB" in markdown
    assert HardwareResult.from_dict(hw.to_dict()) == hw
    assert hw.to_dict()["d2h_bytes_per_s"] == 1e10 and _HW.to_dict()["d2h_bytes_per_s"] is None


def test_setting_counts_the_runs_that_finished() -> None:
    rows = list(_report().systems)
    rows[1] = dataclasses.replace(rows[1], runs=2, failed_runs=1)  # one DCP run not started
    text = to_markdown(BenchReport(_INFO, _HW, tuple(rows)))
    assert "median of 2-3 runs (3 planned) per system" in text
    assert "Fewer than 3 runs: a check of the harness" in text
