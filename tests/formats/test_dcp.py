"""torch.distributed.checkpoint folders loaded online, resharded, without running their code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.errors import UnsafeObjectError

from ..distributed import run_ranks
from ..tools.forged_pickle import FORGERIES, forge_metadata
from .jobs import dcp_full, dcp_load, dcp_save


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    run_ranks(2, dcp_save, str(folder))
    return folder


def test_saved_at_two_ranks_loads_at_one(dcp_folder: Path) -> None:
    full = dcp_full()
    state = {"model": {k: torch.zeros_like(v) for k, v in full.items()}, "step": 0}
    report = unickpt.load(dcp_folder, state)
    for k, v in full.items():
        assert torch.equal(state["model"][k], v), k
    assert state["step"] == 7
    assert report.bytes_read == sum(v.numel() * v.element_size() for v in full.values())
    assert report.unverified_files and all(f.endswith(".distcp") for f in report.unverified_files)


def test_saved_at_two_ranks_loads_at_two_in_another_layout(dcp_folder: Path) -> None:
    for equal, bytes_read, held in run_ranks(2, dcp_load, str(dcp_folder)):
        assert equal
        assert bytes_read == held


@pytest.mark.parametrize("how", list(FORGERIES))
def test_forged_metadata_is_refused_without_running_it(
    tmp_path: Path, dcp_folder: Path, how: str
) -> None:
    folder = tmp_path / "forged"
    folder.mkdir()
    for f in dcp_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    marker = tmp_path / "ran"
    forge_metadata(folder, how, marker)
    state = {"model": {k: torch.zeros_like(v) for k, v in dcp_full().items()}, "step": 0}
    with pytest.raises(UnsafeObjectError, match=FORGERIES[how]):
        unickpt.load(folder, state)
    assert not marker.exists()
