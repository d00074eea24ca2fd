"""torch.save files -> unickpt -> unickpt.load, bitwise."""

from __future__ import annotations

import argparse
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
