"""torch.save files -> unickpt -> unickpt.load, bitwise."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.errors import CheckpointError
from unickpt.tools import import_torch

from .helpers import assert_bitwise, assert_same, make_model, plain_state, zeros_like


def test_torch_file_roundtrip(tmp_path: Path) -> None:
    state = plain_state()
    torch.save(state, tmp_path / "c.pt")
    report = import_torch(tmp_path / "c.pt", tmp_path / "c")
    assert (report.tensors, report.values) == (6, 2)
    dest = zeros_like(state)
    unickpt.load(tmp_path / "c", dest)
    assert_same(dest, state)


def test_torch_file_into_module_with_prefix(tmp_path: Path) -> None:
    model = make_model(3)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    import_torch(tmp_path / "m.pt", tmp_path / "c", prefix="model")
    fresh = make_model(4)
    unickpt.load(tmp_path / "c", {"model": fresh})
    for k, v in model.state_dict().items():
        assert_bitwise(fresh.state_dict()[k], v, k)


@pytest.mark.parametrize("obj", [argparse.Namespace(a=1), complex(1, 2)])
def test_objects_needing_pickle_are_refused(tmp_path: Path, obj: object) -> None:
    torch.save({"w": torch.ones(2), "obj": obj}, tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match="--allow-pickle"):
        import_torch(tmp_path / "c.pt", tmp_path / "c")
    import_torch(tmp_path / "c.pt", tmp_path / "c", allow_pickle=True)
    dest = {"w": torch.zeros(2), "obj": None}
    unickpt.load(tmp_path / "c", dest, allow_pickle=True)
    assert dest["obj"] == obj


def test_legacy_torch_format(tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 3), "step": 1}
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    import_torch(tmp_path / "old.pt", tmp_path / "c")
    dest = {"w": torch.zeros(3, 3), "step": 0}
    unickpt.load(tmp_path / "c", dest)
    assert_same(dest, state)


def test_import_reports_progress_up_to_the_bytes_written(tmp_path: Path) -> None:
    state = plain_state()
    torch.save(state, tmp_path / "c.pt")
    calls: list[tuple[int, int]] = []
    report = import_torch(
        tmp_path / "c.pt", tmp_path / "c", progress=lambda d, t: calls.append((d, t))
    )
    done = [d for d, _ in calls]
    assert calls and done == sorted(done)
    assert calls[-1][0] == calls[-1][1] >= report.tensor_bytes


def test_a_file_that_is_not_torch_save_says_what_it_is(tmp_path: Path) -> None:
    (tmp_path / "hostname").write_text("myhost\n")
    with pytest.raises(CheckpointError) as raised:
        import_torch(tmp_path / "hostname", tmp_path / "c")
    message = str(raised.value)
    assert "is not a torch.save file (it starts with b'myhost\\n')" in message
    assert "allow-pickle" not in message and "allow_pickle" not in message
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is not a torch.save file \(it is empty\)"):
        import_torch(tmp_path / "empty.pt", tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_a_plain_pickle_still_gets_the_allow_pickle_hint(tmp_path: Path) -> None:
    # A real pickle (not torch.save's zip) that weights_only refuses: code execution is the
    # only way to read it, so the hint stays.
    with open(tmp_path / "p.pkl", "wb") as f:
        pickle.dump({"obj": argparse.Namespace(a=1)}, f, protocol=4)
    with pytest.raises(CheckpointError, match="--allow-pickle"):
        import_torch(tmp_path / "p.pkl", tmp_path / "c")
