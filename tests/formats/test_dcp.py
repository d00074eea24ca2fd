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


def test_megatron_torch_dist_tensors_load_online(tmp_path: Path) -> None:
    """Megatron-Core's torch_dist backend is DCP underneath: its tensors (and sharded objects)
    load as they are; its common.pt (iteration, args) is a separate torch.save file."""
    pytest.importorskip("megatron.core")
    from ..tools.megatron_job import full_tensors, save_megatron

    path = tmp_path / "iter_0000007"
    path.mkdir()
    run_ranks(2, save_megatron, str(path))
    full = full_tensors()
    whole = {k: torch.zeros_like(v) for k, v in full.items()}
    state = {**whole, "rng_state/shard_0_2": None}
    report = unickpt.load(path, state, strict=False)
    for key, value in full.items():
        assert torch.equal(whole[key], value), key
    assert state["rng_state/shard_0_2"] == [{"seed": 1234}]  # Megatron wraps it in a list
    assert report.bytes_read == sum(v.numel() * v.element_size() for v in full.values())
