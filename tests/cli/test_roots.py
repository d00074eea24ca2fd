"""The commands on Checkpointer roots (newest committed step, or --step N), convert's
--no-verify, failed conversions that leave nothing behind, and the --allow-pickle hint."""

from __future__ import annotations

import glob
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from unickpt.cli.main import main
from unickpt.storage import open_storage
from unickpt.tools.convert import ConvertOptions, import_checkpoint

from ..tools.helpers import save_sample

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((3, 5), float(step)), "step": step}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A Checkpointer root with steps 1-3 committed and an unfinished step 4."""
    with unickpt.Checkpointer(tmp_path / "run", mode="sync") as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step))
    (tmp_path / "run" / "step-000000004").mkdir()
    (tmp_path / "run" / "step-000000004" / "data-x-00000.bin").write_bytes(b"partial")
    return tmp_path / "run"


def test_commands_take_the_newest_committed_step(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(root)]) == 0
    assert f"{root}/step-000000003" in capsys.readouterr().out
    assert main(["inspect", str(root), "--step", "1", "--json"]) == 0
    assert capsys.readouterr().out.count("step-000000001") == 1
    assert main(["verify", str(root)]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {root}/step-000000003")
    assert main(["diff", str(root), str(root / "step-000000003")]) == 0
    assert main(["diff", str(root), str(root / "step-000000003"), "--step", "2"]) == 1
    capsys.readouterr()
    out = tmp_path / "w.pt"
    assert main(["convert", str(root), str(out), "--to", "torch", "--step", "2"]) == 0
    assert torch.load(out, weights_only=True)["step"] == 2


def test_steps_that_are_not_there(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(root), "--step", "4"]) == 2
    err = capsys.readouterr().err
    assert "step 4 is not a committed checkpoint" in err and "1, 2, 3" in err
    assert main(["inspect", str(root / "step-000000002"), "--step", "2"]) == 2
    assert "is a checkpoint, not a Checkpointer root" in capsys.readouterr().err
    unfinished = tmp_path / "unfinished"
    (unfinished / "step-000000007").mkdir(parents=True)
    assert main(["inspect", str(unfinished)]) == 2
    assert "hold no committed checkpoint" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def _damage(ckpt: Path) -> None:
    data = next(ckpt.glob("data-*.bin"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize(("fmt", "dst"), [("safetensors", "hf"), ("torch", "m.pt"), ("dcp", "dcp")])
def test_a_failed_export_leaves_nothing_and_no_verify_exports(
    tmp_path: Path, fmt: str, dst: str, capsys: pytest.CaptureFixture[str]
) -> None:
    save_sample(tmp_path / "c")
    _damage(tmp_path / "c")
    target = tmp_path / "new" / "deeper" / dst
    assert main(["convert", str(tmp_path / "c"), str(target), "--to", fmt]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert main(["convert", str(tmp_path / "c"), str(target), "--to", fmt, "--no-verify"]) == 0
    assert target.exists()
    capsys.readouterr()
    assert main(["convert", str(target), str(tmp_path / "x"), "--from", fmt, "--no-verify"]) == 2
    assert "apply to exports" in capsys.readouterr().err


def test_a_failed_import_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_sample(tmp_path / "c")
    assert main(["convert", str(tmp_path / "c"), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    biggest = max(glob.glob(str(tmp_path / "dcp" / "*.distcp")), key=os.path.getsize)
    os.truncate(biggest, 100)
    target = tmp_path / "new" / "deeper" / "ckpt"
    assert main(["convert", str(tmp_path / "dcp"), str(target), "--from", "dcp"]) == 2
    assert "has 100 bytes but the DCP metadata places" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_save_that_fails_midway_in_an_import_leaves_nothing(tmp_path: Path) -> None:
    """The save starts (lock, folder, data file) and fails on a tensor without data: what it
    wrote goes, what was there stays, a URL's folder goes."""
    torch.save({"w": torch.empty(3, device="meta"), "v": torch.ones(2)}, tmp_path / "m.pt")
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    url = f"memory://import-{uuid.uuid4().hex[:8]}"
    for dst in (str(tmp_path / "keep"), str(tmp_path / "new" / "x"), f"{url}/x"):
        with pytest.raises((NotImplementedError, unickpt.CheckpointError)):
            import_checkpoint(tmp_path / "m.pt", dst, "torch", ConvertOptions())
    assert os.listdir(tmp_path / "keep") == ["notes.txt"]
    assert not (tmp_path / "new").exists()
    assert open_storage(url).list_names() == []


class Guarded:
    """Loads from a torch.save file with a lock inside, which pickle cannot store again."""

    def __init__(self) -> None:
        self.value = 3

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()


def test_the_allow_pickle_hint_only_when_the_flag_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"w": torch.ones(2), "obj": Guarded()}, tmp_path / "g.pt")
    argv = ["convert", str(tmp_path / "g.pt"), str(tmp_path / "out"), "--from", "torch"]
    assert main(argv) == 2
    assert capsys.readouterr().err.count("--allow-pickle") == 1
    assert main([*argv, "--allow-pickle"]) == 2
    err = capsys.readouterr().err
    assert "pickle cannot store" in err and "lock" in err
    assert "--allow-pickle" not in err and "allow_pickle=True" not in err
    assert not (tmp_path / "out").exists()
