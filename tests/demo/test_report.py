from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from unickpt.demo.chart import write_chart
from unickpt.demo.config import DemoConfig
from unickpt.demo.events import Loaded, PhaseStarted, SaveStarted, StepDone, WorkerKilled
from unickpt.demo.record import DemoResult, Recorder, compare_with_reference
from unickpt.demo.report import format_phases, format_saves, format_verdicts, write_summary


def _result(tmp_path: Path) -> DemoResult:
    recorder = Recorder()
    events = [PhaseStarted("reference", "reference, 2 processes", 2, 4, 100, False)]
    events += [StepDone("reference", s, 4.0 - s / 2, f"d{s}") for s in range(1, 5)]
    events += [PhaseStarted("train", "train, 2 processes", 2, 4, 100, False)]
    events += [StepDone("train", 1, 3.5), StepDone("train", 2, 3.0, "d2")]
    events += [SaveStarted("train", 2, 0.01), WorkerKilled("train", 1, 42, 2)]
    events += [PhaseStarted("resume-1", "resume, 1 process", 1, 4, 100, True)]
    events += [Loaded("resume-1", 2, 0.2, "d2"), StepDone("resume-1", 3, 2.5000001)]
    events += [StepDone("resume-1", 4, 2.0, "d4")]
    for event in events:
        recorder(event)
    phases = list(recorder.phases.values())
    config = DemoConfig(out_dir=str(tmp_path), steps=8, save_every=2)
    return DemoResult(
        config=config,
        phases=phases,
        comparisons=compare_with_reference(phases, phases[0], config.loss_tolerance),
        summary_path=str(tmp_path / "summary.json"),
        chart_path=str(tmp_path / "loss.png"),
        elapsed_s=1.5,
    )


def test_tables_and_verdicts(tmp_path: Path) -> None:
    result = _result(tmp_path)
    phases = format_phases(result.phases)
    assert "rank 1 SIGKILLed during the save of step 2" in phases
    header = phases.splitlines()[0].split()
    assert header == ["phase", "steps", "resumed", "from", "load", "time", "event"]
    assert "200.0 ms" in phases  # the load time
    saves = format_saves(result.phases[1:])
    assert "committed, not timed (crash)" in saves and "10.0 ms" in saves  # step 2 was loaded
    assert saves.endswith("1 save: training stall 10.0 ms on average (at most 10.0 ms)")
    verdicts = [line.strip() for line in format_verdicts(result.comparisons).splitlines()]
    assert verdicts == [
        "[ok] train, 2 processes, steps 1-2",
        "losses: identical to the reference, bit for bit",
        "state at each save: identical to the reference's, bit for bit",
        "[ok] resume, 1 process, steps 3-4",
        "loaded state of step 2: restored bit for bit",
        "losses: within 1.0e-07 of the reference (tolerance 1e-03), as sums run in another order",
        "state at each save: identical to the reference's, bit for bit",
    ]


def test_summary_is_json_with_every_phase(tmp_path: Path) -> None:
    result = _result(tmp_path)
    write_summary(result)
    summary = json.loads(Path(result.summary_path).read_text())
    assert summary["version"] == 1 and summary["all_match"] is True
    assert [p["name"] for p in summary["phases"]] == ["reference", "train", "resume-1"]
    assert summary["phases"][1]["killed"]["step"] == 2
    assert summary["phases"][0]["losses"][0] == [1, 3.5]
    assert [c["matches"] for c in summary["comparisons"]] == [True, True]


def test_chart_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = _result(tmp_path)
    path = write_chart(result.config, result.phases, result.comparisons, str(tmp_path / "c.png"))
    assert path is not None
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_there_is_no_chart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail
    result = _result(tmp_path)
    path = write_chart(result.config, result.phases, result.comparisons, str(tmp_path / "c.png"))
    assert path is None
    assert not (tmp_path / "c.png").exists()


def test_a_resume_that_found_no_checkpoint_says_so(tmp_path: Path) -> None:
    recorder = Recorder()
    events = [PhaseStarted("reference", "reference", 2, 2, 100, False)]
    events += [StepDone("reference", 1, 3.0), StepDone("reference", 2, 2.5, "d2")]
    events += [PhaseStarted("resume-1", "resume, 1 process", 1, 2, 100, True)]
    events += [Loaded("resume-1", None, 0.01, "d0"), StepDone("resume-1", 1, 3.0)]
    for event in events:
        recorder(event)
    phases = list(recorder.phases.values())
    text = format_verdicts(compare_with_reference(phases, phases[0], 1e-3))
    assert "no checkpoint was committed before the crash: started from step 0" in text
    assert "[ok] resume, 1 process, steps 1-1" in text
