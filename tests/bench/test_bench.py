"""The benchmark harness end to end on a tiny model with 2 ranks: reports are written and hold
one verified row per system. No timing is asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from unickpt.bench import BenchConfig, parse_param_count, parse_systems, run_bench, write_outputs
from unickpt.bench.harness import within_budget
from unickpt.bench.model import config_for_params
from unickpt.bench.report import to_markdown
from unickpt.bench.systems.registry import ALL_SYSTEMS, PEER_SYSTEMS
from unickpt.cli import bench as bench_cli


def test_parse_param_count() -> None:
    assert parse_param_count("10M") == 10_000_000
    assert parse_param_count("1.5B") == 1_500_000_000
    assert parse_param_count("250000") == 250_000
    with pytest.raises(ValueError, match="K/M/B"):
        parse_param_count("ten")


def test_parse_systems() -> None:
    assert parse_systems("dcp, torch-save,dcp") == ("dcp", "torch-save")
    assert parse_systems("unickpt,dcp,torch") == ("unickpt", "dcp", "torch-save")
    assert parse_systems("all") == ALL_SYSTEMS
    assert parse_systems("peers") == PEER_SYSTEMS
    with pytest.raises(ValueError, match="unknown system"):
        parse_systems("dcp,nope")


@pytest.mark.parametrize("target", [1_000_000, 10_000_000, 100_000_000])
def test_model_size_is_close_to_target(target: int) -> None:
    config = config_for_params(target)
    assert 0.5 * target < config.param_count < 2 * target
    assert config.d_model % 64 == 0


def test_cli_registers_bench() -> None:
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--params", "10M", "--systems", "dcp"])
    assert args.func is bench_cli.run
    assert args.params == "10M"


def test_cli_options() -> None:
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--repeats", "5", "--device", "cuda"])
    assert (args.repeats, args.device) == (5, "cuda")
    assert "--repeats 5" in bench_cli._command(args) and "--device cuda" in bench_cli._command(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--device", "tpu"])
    with pytest.raises(ValueError, match="repeats"):
        BenchConfig(1_000_000, 2, ("dcp",), Path("o"), Path("w"), repeats=0)


def test_time_budget_option() -> None:
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--time-budget", "120"])
    assert args.time_budget == 120.0 and "--time-budget 120" in bench_cli._command(args)
    assert parser.parse_args(["bench"]).time_budget is None
    with pytest.raises(ValueError, match="time budget 0 s must be positive"):
        BenchConfig(1_000_000, 1, ("dcp",), Path("o"), Path("w"), time_budget_s=0)


def test_within_budget() -> None:
    assert within_budget(90.0, 30.0, 120.0)
    assert not within_budget(90.5, 30.0, 120.0)
    assert within_budget(1e9, 1e9, None)


@pytest.mark.timeout(600)
def test_time_budget_skips_the_runs_that_would_pass_it(tmp_path: Path) -> None:
    config = BenchConfig(
        params=200_000,
        world=1,
        systems=("dcp", "torch-save"),
        out=tmp_path / "out",
        workdir=tmp_path / "work",
        seq_len=16,
        repeats=2,
        time_budget_s=0.001,  # spent by the hardware job: no run starts
    )
    lines: list[str] = []
    report = run_bench(config, lines.append)
    assert lines == ["measuring the hardware", "time budget of 0.001 s spent: 4 runs"]
    assert report.hardware is not None
    for row in report.systems:
        assert (row.status, row.runs, row.failed_runs) == ("skipped", 0, 2)
        assert row.message == "not started: the time budget of 0.001 s was spent (--time-budget)"


@pytest.mark.timeout(600)
def test_harness_writes_reports(tmp_path: Path) -> None:
    # unickpt's and torch.save's rows, measured as a job measures them: test_runner.py
    systems = ("dcp", "torchsnapshot")
    config = BenchConfig(
        params=200_000,
        world=2,
        systems=systems,
        out=tmp_path / "out",
        workdir=tmp_path / "work",
        peers_python=None,
        seq_len=16,
        warmup=False,
        command="unickpt bench --params 200K --repeats 1",
        repeats=1,
    )
    lines: list[str] = []
    report = run_bench(config, lines.append)
    paths = write_outputs(report, config.out)
    # torchsnapshot: no peers environment, so no run
    assert lines == ["measuring the hardware", "run 1/1: dcp (repeat 1 of 1)"]

    data = json.loads(paths["json"].read_text())
    rows = {row["name"]: row for row in data["systems"]}
    assert set(rows) == set(systems)
    assert rows["torchsnapshot"]["status"] == "not installed"
    row = rows["dcp"]
    assert row["status"] == "ok", row
    assert row["runs"] == 1 and row["failed_runs"] == 0
    assert row["verified"] == {"load": True, "reshard load": True}
    assert row["figures"]["bytes_written"]["median"] > 0
    assert {"blocking_s", "stall_s", "durable_s"} <= set(row["figures"])
    assert "thread_count=4" in row["notes"]
    assert data["hardware"]["total_bytes"] == data["info"]["state_bytes"] > 0
    assert data["info"]["repeats"] == 1

    markdown = paths["markdown"].read_text()
    assert markdown == to_markdown(report)
    for row in report.systems:
        assert f"| {row.label} |" in markdown
    assert ("png:stall" in paths) == ("png:durable" in paths)  # both or none (matplotlib)
    assert not list((tmp_path / "work").glob("job-*"))  # every job's checkpoints removed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_run_is_skipped_without_cuda(tmp_path: Path) -> None:
    config = BenchConfig(
        params=200_000,
        world=2,
        systems=("unickpt", "dcp-async-process"),
        out=tmp_path / "out",
        workdir=tmp_path / "work",
        device="cuda",
    )
    report = run_bench(config)
    assert [row.status for row in report.systems] == ["skipped", "skipped"]
    assert "no CUDA device" in report.systems[0].message
    assert report.hardware is None and report.info.device == "cuda"
    paths = write_outputs(report, config.out)
    assert not [k for k in paths if k.startswith("png:")]
    assert "| unickpt save | skipped: --device cuda" in paths["markdown"].read_text()


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_harness_on_cuda(tmp_path: Path) -> None:
    config = BenchConfig(
        params=1_000_000,
        world=1,
        systems=("unickpt", "unickpt-zero-stall", "dcp-async-thread", "dcp-async-process"),
        out=tmp_path / "out",
        workdir=tmp_path / "work",
        seq_len=16,
        repeats=1,
        device="cuda",
    )
    report = run_bench(config)
    for row in report.systems:
        assert row.status == "ok", row
        assert row.verified == {"load": True, "reshard load": True}, row
        assert "save_peak_gpu_bytes" in row.figures
    assert report.hardware is not None and report.hardware.device_copy_bytes > 0
    assert report.hardware.d2h_s > 0 and report.hardware.h2d_s > 0
