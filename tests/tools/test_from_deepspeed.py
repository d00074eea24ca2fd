from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from tests.distributed import run_ranks
from unickpt.errors import CheckpointError, CheckpointNotFoundError
from unickpt.tools import import_checkpoint
from unickpt.tools.convert import ConvertOptions

pytest.importorskip("deepspeed", reason="needs deepspeed: pip install 'unickpt[deepspeed]'")

from .deepspeed_job import Net, save_deepspeed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    """ZeRO stage 1, 2 and 3 checkpoints of one small job, and DeepSpeed's full values."""
    root = tmp_path_factory.mktemp("deepspeed")
    full = run_ranks(2, save_deepspeed, str(root), [1, 2, 3], timeout_s=600)[0]
    for stage in (2, 3):
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        command += ["--input_folder", str(root / f"stage{stage}" / "global_step2")]
        command += ["--output_folder", str(root / f"universal{stage}")]
        command += ["--num_extract_workers", "1", "--num_merge_workers", "1"]
        subprocess.run(command, check=True, capture_output=True)
    return root, full


@pytest.mark.parametrize("source", ["stage1", "stage2", "stage3", "universal2", "universal3"])
def test_import_and_resume_into_a_torch_optimizer(
    deepspeed_runs: tuple[Path, dict[int, Any]], source: str, tmp_path: Path
) -> None:
    root, full = deepspeed_runs
    options = ConvertOptions(allow_pickle=True)
    import_checkpoint(root / source, tmp_path / "c", "deepspeed", options)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    state: dict[str, Any] = {"model": net, "optimizer": opt}
    unickpt.load(tmp_path / "c", state, strict=False)
    expected = full[int(source[-1])]
    for name, p in net.named_parameters():
        weight, exp_avg, exp_avg_sq = (torch.tensor(v) for v in expected[name])
        assert torch.equal(p.detach(), weight), name
        assert torch.equal(opt.state[p]["exp_avg"], exp_avg), name
        assert torch.equal(opt.state[p]["exp_avg_sq"], exp_avg_sq), name
        if source != "universal3":  # ZeRO-3's universal files carry no step
            assert float(opt.state[p]["step"]) == 2.0
    assert torch.equal(net.scale, torch.tensor([2.0]))
    steps = {"global_steps": None, "lr_scheduler": {"last_epoch": None}}
    unickpt.load(tmp_path / "c", steps, strict=False)
    assert steps == {"global_steps": 2, "lr_scheduler": {"last_epoch": 2}}
    if not source.startswith("universal"):
        assert opt.param_groups[0]["lr"] == pytest.approx(0.0025)  # the saved group's values


def test_not_deepspeed(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no complete set of zero_pp_rank"):
        import_checkpoint(tmp_path, tmp_path / "c", "deepspeed", ConvertOptions())
    (tmp_path / "zero_pp_rank_0_mp_rank_01_optim_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="ds_to_universal"):
        import_checkpoint(tmp_path, tmp_path / "c", "deepspeed", ConvertOptions())
