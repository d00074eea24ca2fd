"""``unickpt bench --workload dlrm``, small: bytes per checkpoint of full, quantized and
incremental saves, the loss of a model restored from each, the tuner's decisions. No timing is
asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unickpt.cli.main import main

TABLES, ROWS, DIM = 2, 4000, 32


def test_dlrm_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = f"--tables {TABLES} --rows {ROWS} --dim {DIM} --batch 128 --warm-steps 10 --saves 3 "
    args += "--steps-between 2 --more-steps 5 --tuner-steps 12 --max-overhead 0.5 --no-shm"
    assert main(["bench", "--workload", "dlrm", "--out", str(tmp_path), *args.split()]) == 0
    out = capsys.readouterr().out
    assert "| incremental + 8-bit |" in out and "| disk | full |" in out
    assert "`unickpt bench --workload dlrm --tables 2 --rows 4000 --dim 32" in out
    result = json.loads((tmp_path / "dlrm.json").read_text())
    assert (tmp_path / "dlrm.md").read_text().startswith("`unickpt bench --workload dlrm")
    assert not (tmp_path / "ckpt-tmp").exists()
    v = result["variants"]
    assert list(v) == [
        "full",
        "8-bit",
        "4-bit",
        "incremental",
        "incremental + 8-bit",
        "incremental + 4-bit",
    ]
    table_bytes = TABLES * ROWS * DIM * 4
    others = v["full"]["data_bytes_per_checkpoint"] - table_bytes  # the MLPs, padding
    for name, row_bytes in (("8-bit", 8 + DIM), ("4-bit", 8 + DIM // 2)):
        stored = v[name]["data_bytes_per_checkpoint"] - TABLES * ROWS * row_bytes
        assert abs(stored - others) < 64 * 16  # chunks start 64-byte aligned
        for kind in (name, "incremental + " + name):
            assert abs(v[kind]["loss_vs_full"]) < 0.01  # within 1% of the unquantized restore
            assert 0 < v[kind]["rms_relative_error"] < (0.01 if name == "8-bit" else 0.1)
            # a first incremental save is full (metadata lengths may differ by a few bytes)
            assert abs(v[kind]["first_save_bytes"] - v[name]["first_save_bytes"]) < 256
    assert v["full"]["loss_vs_full"] == 0.0 and v["full"]["max_abs_error"] == 0.0
    assert v["incremental"]["loss_vs_full"] == 0.0  # lossless
    assert abs(v["incremental"]["first_save_bytes"] - v["full"]["first_save_bytes"]) < 256
    # changed rows only: fewer bytes than the whole tables; quantized rows fewer still
    assert v["incremental"]["bytes_per_checkpoint"] < v["full"]["bytes_per_checkpoint"] / 2
    for bits in ("8-bit", "4-bit"):
        inc = v["incremental + " + bits]
        assert inc["data_bytes_per_checkpoint"] < v["incremental"]["data_bytes_per_checkpoint"]
        assert inc["bytes_vs_full"] > v[bits]["bytes_vs_full"]
    jobs = result["tuner"]
    assert [j["variant"] for j in jobs] == ["full", "incremental + 8-bit"]
    for job in jobs:
        assert job["saves"] >= 1 and job["every"] >= 1
        assert job["decisions"] and job["every"] == job["decisions"][-1][1]
