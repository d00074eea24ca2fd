"""The inspect, verify, diff and convert commands, run in-process and once in a process of
its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import unickpt
from tests.cli.forked_cli import run_cli
from unickpt.cli.main import main
from unickpt.engine.tensor_reader import CheckpointReader

from ..tools.helpers import assert_bitwise, make_model, save_sample

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    save_sample(tmp_path / "c")
    return tmp_path / "c"


@pytest.mark.parametrize(
    ("command", "phrase"),
    [
        ("inspect", "world size"),
        ("verify", "exit status"),
        ("diff", "exit status"),
        ("convert", "--max-shard-size"),
    ],
)
def test_help(command: str, phrase: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert phrase in capsys.readouterr().out


def test_inspect_table_and_json(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "world size 1" in out
    assert "buffers.big" in out and "[257, 129]" in out and "replicated" in out
    assert "train.name" in out and "'run-a'" in out
    assert main(["inspect", str(ckpt), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["totals"]["tensors"] == len(doc["tensors"])


def test_verify_ok_damaged_and_missing(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(ckpt)]) == 0
    assert capsys.readouterr().out.startswith("OK: ")
    with CheckpointReader(ckpt) as reader:
        (chunk,) = reader.metadata.tensors["buffers.big"].chunks
        data = ckpt / reader.metadata.files[chunk.file]
    raw = bytearray(data.read_bytes())
    raw[chunk.byte_offset + 7] ^= 0x80
    data.write_bytes(bytes(raw))
    assert main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("DAMAGED: ")
    assert "checksum mismatch" in out and data.name in out and "'buffers.big'" in out
    assert main(["verify", str(ckpt.parent / "missing")]) == 2
    assert "error: no checkpoint" in capsys.readouterr().err


def test_diff_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = save_sample(tmp_path / "a")
    unickpt.save(tmp_path / "b", state)
    state["buffers"]["big"][0, 0] += 2.0
    state["step"] = 13
    unickpt.save(tmp_path / "c", state)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out.startswith("identical: ")
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "buffers.big" in out and "values differ" in out and "step" in out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"][0]["max_abs"] == pytest.approx(2.0)


def test_convert_round_trips(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tmp_path / "hf"
    argv = ["convert", str(ckpt), str(hf), "--to", "safetensors", "--only", "model"]
    assert main([*argv, "--max-shard-size", "500B", "--progress"]) == 0
    captured = capsys.readouterr()
    assert "exporting (safetensors)" in captured.err
    assert (hf / "model.safetensors.index.json").is_file()
    assert (
        main(
            [
                "convert",
                str(hf),
                str(tmp_path / "back"),
                "--from",
                "safetensors",
                "--prefix",
                "model",
            ]
        )
        == 0
    )
    fresh = make_model(seed=9)
    unickpt.load(tmp_path / "back", {"model": fresh})
    with CheckpointReader(ckpt) as reader:
        for key, value in fresh.state_dict().items():
            assert_bitwise(value, reader.read_tensor(f"model.{key}"), key)
    assert main(["convert", str(ckpt), str(tmp_path / "c.pt"), "--to", "torch"]) == 0
    assert torch.load(tmp_path / "c.pt", weights_only=True)["step"] == 12
    assert (
        main(["convert", str(tmp_path / "c.pt"), str(tmp_path / "again"), "--from", "torch"]) == 0
    )
    assert main(["convert", str(ckpt), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "d"), "--from", "dcp"]) == 0
    capsys.readouterr()
    assert main(["diff", str(ckpt), str(tmp_path / "d")]) == 0
    assert main(["diff", str(tmp_path / "again"), str(tmp_path / "d")]) == 0


def test_convert_refuses_misuse(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = str(tmp_path / "x")
    assert main(["convert", str(ckpt), dst, "--to", "torch", "--max-shard-size", "1GB"]) == 2
    assert "--max-shard-size applies to --to safetensors" in capsys.readouterr().err
    assert main(["convert", str(ckpt), dst, "--to", "safetensors", "--max-shard-size", "lots"]) == 2
    assert "not understood" in capsys.readouterr().err
    assert main(["convert", str(ckpt), dst, "--from", "torch"]) == 2
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", str(ckpt), dst])


def test_as_a_subprocess(ckpt: Path, tmp_path: Path) -> None:
    """``python -m unickpt.cli.main`` in a process of its own (forked with torch imported; the
    closed-pipe tests of test_unix.py start it as a new interpreter)."""
    done = run_cli(["inspect", str(ckpt), "--json"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["world_size"] == 1
