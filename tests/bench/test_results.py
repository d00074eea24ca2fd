"""Folding ranks into a run and runs into a row: maximum or sum per measure, median with its
lowest and highest run, verification of every run."""

from __future__ import annotations

import pytest

from unickpt.bench.harness import schedule
from unickpt.bench.measures import MEASURES, measure
from unickpt.bench.results import (
    STATUS_OK,
    STATUS_TIMEOUT,
    Figure,
    RankMeasurement,
    RunResult,
    SystemResult,
    combine,
    summarize,
)


def test_combine_folds_ranks_per_measure() -> None:
    ranks = [
        RankMeasurement(
            {"durable_s": 1.0, "bytes_written": 10.0, "load_s": 0.5}, {"load": 0, "reshard load": 0}
        ),
        RankMeasurement(
            {"durable_s": 2.0, "bytes_written": 30.0},
            {"load": 0, "reshard load": 2},
            ("reshard load: slow",),
        ),
    ]
    run = combine(ranks)
    assert run.values == {"durable_s": 2.0, "bytes_written": 40.0}  # load_s: one rank lacks it
    assert run.verified == {"load": True, "reshard load": False}
    assert run.message == "reshard load: slow"


def test_combine_marks_a_failed_load_unverified() -> None:
    ranks = [RankMeasurement({}, {"load": None, "reshard load": 0})] * 2
    assert combine(ranks).verified == {"load": None, "reshard load": True}


def _run(durable: float, verified: bool = True) -> RunResult:
    return RunResult({"durable_s": durable}, {"load": verified, "reshard load": True})


def test_summarize_takes_median_and_range() -> None:
    row = summarize("dcp", "DCP save", "notes", [_run(0.44), _run(0.37), _run(0.39)], [])
    assert row.status == STATUS_OK and row.runs == 3 and row.failed_runs == 0
    assert row.figures["durable_s"] == Figure(0.39, 0.37, 0.44, (0.44, 0.37, 0.39))
    assert row.median("durable_s") == 0.39 and row.median("load_s") is None
    assert row.verified == {"load": True, "reshard load": True}
    assert SystemResult.from_dict(row.to_dict()) == row


def test_summarize_one_bad_run_fails_verification() -> None:
    row = summarize("x", "X", "", [_run(1.0), _run(1.0, verified=False)], [])
    assert row.verified["load"] is False


def test_summarize_failed_runs() -> None:
    failure = (STATUS_TIMEOUT, "job timed out; see logs/x-2.log")
    row = summarize("x", "X", "", [_run(1.0), _run(2.0)], [failure])
    assert row.status == STATUS_OK and row.failed_runs == 1
    assert row.message.startswith("1 of 3 runs failed: timeout: job timed out")
    none = summarize("x", "X", "", [], [failure, failure])
    assert (none.status, none.message, none.failed_runs) == (STATUS_TIMEOUT, failure[1], 2)


def test_schedule_alternates_systems() -> None:
    assert schedule(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    order = [name for _, name in schedule(["a", "b", "c"], 3)]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert schedule([], 3) == []


def test_measures_are_declared_once() -> None:
    keys = [m.key for m in MEASURES]
    assert len(keys) == len(set(keys))
    assert measure("stall_s").fold == "max" and measure("bytes_written").fold == "sum"
    with pytest.raises(KeyError, match="add it to MEASURES"):
        measure("nope")
