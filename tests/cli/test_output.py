"""What the commands print: grouped values and filters (inspect), problems grouped by file
(verify), where strings differ (diff), tied tensors left out (convert), messages that name the
command's flags and the folder a Hugging Face checkpoint keeps its checkpoint in."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import unickpt
from unickpt.cli.main import main
from unickpt.engine.tensor_reader import CheckpointReader

from ..tools.helpers import make_tied_model, save_sample
from ..tools.test_inspect import _titan_like

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_inspect_groups_repeated_values_and_filters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _titan_like(tmp_path / "c", layers=16)
    assert main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "values: 129 (5 distinct, see --expand)" in out
    line = next(x for x in out.splitlines() if x.startswith("optimizer.param_groups.layers.*.lr"))
    assert line.split()[1:] == ["float", "0.0003", "32"]
    assert "optimizer.param_groups.layers.3.wq.lr" not in out
    assert main(["inspect", str(tmp_path / "c"), "--expand"]) == 0
    expanded = capsys.readouterr().out
    assert "optimizer.param_groups.layers.3.wq.lr" in expanded
    assert len(out.splitlines()) < len(expanded.splitlines()) - 100
    argv = ["inspect", str(tmp_path / "c"), "--only", "model", "--keys", "*.3.*", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [t["key"] for t in doc["tensors"]] == ["model.layers.3.wk", "model.layers.3.wq"]
    assert doc["objects"] == [] and doc["totals"]["tensors"] == 2
    assert main(["inspect", str(tmp_path / "c"), "--only", "modle"]) == 2
    err = capsys.readouterr().err
    assert "no such top-level key" in err and "model, optimizer, train_state" in err


def test_verify_groups_the_problems_of_a_truncated_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_sample(tmp_path / "c")
    (data,) = sorted((tmp_path / "c").glob("data-*.bin"))
    data.write_bytes(data.read_bytes()[:200])
    assert main(["verify", str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"DAMAGED: {tmp_path / 'c'}: ") and out[0].endswith(" in 1 file")
    problems = int(out[0].split(": ")[2].split()[0])
    assert problems > 5
    (line,) = [x for x in out if x.startswith("  - ")]
    assert line.startswith(f"  - {data.name}: {problems} problems (")
    assert " more); first: " in line and "truncated" in line
    assert out[-1].startswith("checked: ")
    assert main(["verify", str(tmp_path / "c"), "--json"]) == 1
    assert len(json.loads(capsys.readouterr().out)["damage"]) == problems


def _flip_a_byte(path: Path, key: str) -> None:
    with CheckpointReader(path) as reader:
        (chunk,) = reader.metadata.tensors[key].chunks
        data = path / reader.metadata.files[chunk.file]
    raw = bytearray(data.read_bytes())
    raw[chunk.byte_offset + 3] ^= 0x10
    data.write_bytes(bytes(raw))


def test_checksum_errors_name_the_no_verify_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_sample(tmp_path / "a")
    save_sample(tmp_path / "b")
    _flip_a_byte(tmp_path / "b", "buffers.big")
    out = str(tmp_path / "b.pt")
    assert main(["convert", str(tmp_path / "b"), out, "--to", "torch"]) == 2
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "pass --no-verify to read it anyway" in err
    assert "verify=False" not in err
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "--no-verify" in err and "verify=False" not in err
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--no-verify"]) == 1
    assert "buffers.big" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "b"), out, "--to", "torch", "--no-verify"]) == 0


def test_a_hugging_face_checkpoint_folder_names_its_subfolder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "out" / "checkpoint-500"
    save_sample(folder / "unickpt")
    (folder / "trainer_state.json").write_text("{}")
    save_sample(tmp_path / "other")
    assert main(["diff", str(folder), str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "its subfolder unickpt/ holds one" in err and f"pass {folder}/unickpt." in err
    assert main(["inspect", str(folder) + "/"]) == 2
    assert f"pass {folder}/unickpt." in capsys.readouterr().err
    assert main(["diff", str(folder / "unickpt"), str(tmp_path / "other")]) == 0


def test_diff_shows_where_strings_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = '{"epoch": 3, "global_step": 120' + ", " * 60 + '"seed": 1}'
    unickpt.save(tmp_path / "a", {"lightning": state})
    unickpt.save(tmp_path / "b", {"lightning": state.replace("120", "121")})
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "lightning: first difference at character 30:" in out
    assert '  A ...h": 3, "global_step": 12[0], , , , , , , , , , , , ...' in out
    assert '  B ...h": 3, "global_step": 12[1], , , , , , , , , , , , ...' in out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    (value,) = json.loads(capsys.readouterr().out)["values"]
    assert value["offset"] == 30 and value["context_b"].startswith('...h": 3, "global_step": 12[1]')


def test_convert_says_which_tied_tensor_it_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unickpt.save(tmp_path / "c", {"model": make_tied_model()})
    argv = ["convert", str(tmp_path / "c"), str(tmp_path / "hf"), "--to", "safetensors"]
    assert main([*argv, "--only", "model"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == [
        "left out tied head.weight (same storage as wte.weight); pass --untie to write every key"
    ]
    assert sorted(st.load_file(tmp_path / "hf" / "model.safetensors")) == [
        "head.bias",
        "wte.weight",
    ]
    assert main([*argv, "--only", "model", "--untie", "--overwrite"]) == 0
    assert "left out tied" not in capsys.readouterr().out
    loaded = st.load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(loaded) == ["head.bias", "head.weight", "wte.weight"]
    assert torch.equal(loaded["head.weight"], loaded["wte.weight"])
    assert (
        main(["convert", str(tmp_path / "c"), str(tmp_path / "t.pt"), "--to", "torch", "--untie"])
        == 2
    )
    assert "--untie applies to --to safetensors" in capsys.readouterr().err


def test_inspect_keys_that_match_nothing_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _titan_like(tmp_path / "c", layers=2)
    assert main(["inspect", str(tmp_path / "c"), "--keys", "*.lr", "--keys", "*.nope"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "error: --keys '*.nope' matches no key of" in captured.err


def test_inspect_shows_safetensors_and_dcp_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp

    tensors = {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.int32)}
    st.save_file(tensors, tmp_path / "model.safetensors")
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Hugging Face safetensors, as unickpt.load reads it" in out and "COMMIT" not in out
    rows = {
        line.split()[0]: line.split()[1:3] for line in out.splitlines() if line[:2] in ("w ", "b ")
    }
    assert rows["w"] == ["float32", "[4,"] and rows["b"] == ["int32", "[5]"]
    dcp.save({"m": {"w": torch.randn(6, 2)}, "step": 3}, checkpoint_id=str(tmp_path / "d"))
    assert main(["inspect", str(tmp_path / "d"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["producer"]["foreign_format"] == "dcp"
    assert [(t["key"], t["shape"]) for t in doc["tensors"]] == [("m.w", [6, 2])]
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "COMMIT" in capsys.readouterr().err


def test_diff_compares_two_steps_of_one_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with unickpt.Checkpointer(tmp_path / "run", mode="sync") as ckpt:
        for step in (270, 280, 290):
            ckpt.save(step, {"w": torch.full((3,), float(step)), "step": step})
    assert main(["diff", str(tmp_path / "run"), "--steps", "270", "280"]) == 1
    out = capsys.readouterr().out
    assert f"{ckpt.path(270)} (A) and {ckpt.path(280)} (B)" in out
    assert re.search(r"\nw +values differ +10 ", out), out
    assert main(["diff", str(tmp_path / "run"), "--steps", "290", "290"]) == 0
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "run"), str(tmp_path / "run"), "--steps", "1", "2"]) == 2
    assert "--steps N M compares two steps of root A; B was given too" in capsys.readouterr().err
    assert main(["diff", str(tmp_path / "run")]) == 2
    assert "diff needs two checkpoints" in capsys.readouterr().err


def test_convert_checks_the_destination_before_it_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    optim.step()
    unickpt.save(tmp_path / "c", {"model": model, "optim": optim, "step": 1})
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"earlier")
    argv = ["convert", str(tmp_path / "c"), str(tmp_path / "hf"), "--to", "safetensors"]
    with caplog.at_level("WARNING"):
        assert main(argv) == 2
    assert "already holds a safetensors export" in capsys.readouterr().err
    assert not caplog.records  # refused before any warning about what it would write
    with caplog.at_level("WARNING"):
        assert main([*argv, "--overwrite"]) == 0
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "2 top-level keys (model, optim)" in warned and "pass --only model" in warned
    assert "step: not a tensor" in warned
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert main([*argv, "--overwrite", "--only", "model"]) == 0
    assert not caplog.records
