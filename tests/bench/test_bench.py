"""The benchmark harness end to end on a tiny model with 2 ranks: reports are written and hold
one row per system. No timing is asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from unickpt.bench import BenchConfig, parse_param_count, parse_systems, run_bench, write_outputs
from unickpt.bench.model import config_for_params
from unickpt.bench.report import replace_results, to_markdown
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


@pytest.mark.timeout(600)
def test_harness_writes_reports(tmp_path: Path) -> None:
    systems = ("dcp", "torch-save", "unickpt", "torchsnapshot")
    config = BenchConfig(
        params=200_000,
        world=2,
        systems=systems,
        out=tmp_path / "out",
        workdir=tmp_path / "work",
        peers_python=None,
        seq_len=16,
        warmup=False,
        command="unickpt bench --params 200K",
    )
    report = run_bench(config)
    paths = write_outputs(report, config.out)

    data = json.loads(paths["json"].read_text())
    rows = {row["name"]: row for row in data["systems"]}
    assert set(rows) == set(systems)
    assert rows["torchsnapshot"]["status"] == "not installed"
    for name in ("dcp", "torch-save"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["load_verified"] is True
        assert rows[name]["reshard_verified"] is True
        assert rows[name]["bytes_written"] > 0
    assert data["hardware"]["total_bytes"] == data["info"]["state_bytes"] > 0

    markdown = paths["markdown"].read_text()
    assert markdown == to_markdown(report)
    for row in report.systems:
        assert f"| {row.label} |" in markdown
    if "png" in paths:
        assert paths["png"].stat().st_size > 0


def test_replace_results_block() -> None:
    doc = "# Title\n\n<!-- results:start -->\nold\n<!-- results:end -->\n\nrest\n"
    new = replace_results(doc, "| a |\n", "images/bench.png")
    assert "old" not in new
    assert "| a |" in new and "![checkpoint benchmark](images/bench.png)" in new
    assert new.endswith("<!-- results:end -->\n\nrest\n")
    with pytest.raises(ValueError, match="results"):
        replace_results("no block", "x")
