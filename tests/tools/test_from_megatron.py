from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unickpt
from tests.distributed import run_ranks
from unickpt.errors import CheckpointError, CheckpointNotFoundError
from unickpt.tools import import_checkpoint
from unickpt.tools.convert import ConvertOptions

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'unickpt[megatron]'")

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
