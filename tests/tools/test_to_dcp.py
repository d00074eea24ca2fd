"""unickpt -> torch.distributed.checkpoint folder, loaded by dcp.load without a process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import unickpt
from unickpt.errors import CheckpointExistsError
from unickpt.tools import export_dcp

from .helpers import (
    assert_bitwise,
    empty_like_checkpoint,
    make_model,
    make_tied_model,
    reader_tensors,
    save_sample,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_dcp_load_bitwise(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    report = export_dcp(tmp_path / "c", tmp_path / "dcp")
    state = empty_like_checkpoint(tmp_path / "c")
    state["step"] = 0
    state["train"] = {"name": "", "betas": None}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert state["step"] == 12
    assert state["train"]["name"] == "run-a"
    assert state["train"]["betas"] == (0.9, 0.95)
    for key, t in reader_tensors(tmp_path / "c").items():
        head, _, rest = key.partition(".")
        assert_bitwise(state[head][rest], t, key)
    assert report.tensors == len(reader_tensors(tmp_path / "c"))


def test_dcp_only_subtree_flat_keys(tmp_path: Path, two_rank_checkpoint: Path) -> None:
    export_dcp(two_rank_checkpoint, tmp_path / "dcp", only="model")
    state = empty_like_checkpoint(two_rank_checkpoint)["model"]
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    expected = reader_tensors(two_rank_checkpoint)
    assert set(state) == {"w", "b"}
    for key in ("w", "b"):
        assert_bitwise(state[key], expected[f"model.{key}"], key)


def test_refuses_then_overwrites(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    export_dcp(tmp_path / "c", tmp_path / "dcp", only="buffers")
    with pytest.raises(CheckpointExistsError):
        export_dcp(tmp_path / "c", tmp_path / "dcp")
    report = export_dcp(tmp_path / "c", tmp_path / "dcp", only="model", overwrite=True)
    assert {Path(f).name for f in report.files} == {p.name for p in (tmp_path / "dcp").iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    state = {k: torch.zeros_like(v) for k, v in make_model().state_dict().items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for key, t in reader_tensors(tmp_path / "c").items():
        if key.startswith("model."):
            assert_bitwise(state[key.removeprefix("model.")], t, key)


def test_tied_weights_keep_both_names(tmp_path: Path) -> None:
    model = make_tied_model()
    unickpt.save(tmp_path / "c", {"model": model})
    export_dcp(tmp_path / "c", tmp_path / "dcp", only="model")
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for key, t in model.state_dict().items():
        assert_bitwise(state[key], t, key)
