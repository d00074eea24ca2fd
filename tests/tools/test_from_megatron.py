from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import unickpt
from tests.distributed import run_ranks
from unickpt.errors import CheckpointError, CheckpointNotFoundError, UnsafeObjectError
from unickpt.tools import import_checkpoint
from unickpt.tools.convert import ConvertOptions

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'unickpt[megatron]'")

from .forged_pickle import FORGERIES, forge_metadata
from .megatron_job import full_tensors, save_megatron


@pytest.fixture(scope="module")
def megatron_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("megatron") / "iter_0000007"
    path.mkdir()
    run_ranks(2, save_megatron, str(path))
    return path


def test_import_then_load_in_another_layout(megatron_checkpoint: Path, tmp_path: Path) -> None:
    report = import_checkpoint(megatron_checkpoint, tmp_path / "c", "megatron", ConvertOptions())
    assert report.tensors == 3
    full = full_tensors()
    whole = {k: torch.zeros_like(v) for k, v in full.items()}
    args = {"lr": None, "tensor_model_parallel_size": None}
    rng = {"seed": None}
    state = {**whole, "iteration": None, "args": args, "rng_state/shard_0_2": rng}
    unickpt.load(tmp_path / "c", state, strict=False)
    for key, value in full.items():
        assert torch.equal(whole[key], value), key
    assert state["iteration"] == 7 and args == {"lr": 0.1, "tensor_model_parallel_size": 2}
    assert rng == {"seed": 1234}  # rank 0's ShardedObject
    # a block of another split (rows 3..6 of the column-parallel weight) reads just those rows
    block = torch.zeros(3, 6)
    part = unickpt.ShardedTensor(block, global_shape=(8, 6), offsets=(3, 0))
    unickpt.load(tmp_path / "c", {"decoder.linear_qkv.weight": part}, strict=False)
    assert torch.equal(block, full["decoder.linear_qkv.weight"][3:6])


def test_not_megatron(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"no metadata\.json"):
        import_checkpoint(tmp_path, tmp_path / "c", "megatron", ConvertOptions())
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(CheckpointError, match="'zarr' backend"):
        import_checkpoint(tmp_path, tmp_path / "c", "megatron", ConvertOptions())


@pytest.mark.parametrize("how", list(FORGERIES))
def test_forged_metadata_runs_no_code(megatron_checkpoint: Path, tmp_path: Path, how: str) -> None:
    """The torch_dist backend's .metadata is DCP's pickle: a forged one is refused, naming
    what it would have built, before anything of it runs (its real one, planner data
    included, imports without --allow-pickle: see above)."""
    src = tmp_path / "iter"
    shutil.copytree(megatron_checkpoint, src)
    marker = tmp_path / "ran"
    forge_metadata(src, how, marker)
    with pytest.raises(UnsafeObjectError) as info:
        import_checkpoint(src, tmp_path / "c", "megatron", ConvertOptions())
    message = str(info.value)
    assert f"asks pickle to build {FORGERIES[how]}, which DCP metadata does not hold" in message
    assert "Pass --allow-pickle (allow_pickle=True) only if you trust" in message
    assert not marker.exists(), "the forged metadata ran code"
    assert not (tmp_path / "c").exists()
