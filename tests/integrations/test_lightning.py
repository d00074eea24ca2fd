"""UnickptCheckpointIO under Lightning's Trainer: DDP on 2 CPU processes, fit, stop, resume."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning", reason="needs Lightning: pip install 'unickpt[lightning]'")

from tests.distributed import run_ranks
from unickpt.tools import inspect_checkpoint

pytestmark = pytest.mark.slow


def _module() -> Any:
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return [opt], [sched]

    return Regression()


def _data() -> Any:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=2)  # 4 steps an epoch on each of 2 ranks


def _fit(folder: str, epochs: int, async_save: bool, resume: str | None = None) -> Any:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from unickpt.integrations.lightning import UnickptCheckpointIO

    model = _module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=epochs,
        plugins=[UnickptCheckpointIO(async_save=async_save)],
        callbacks=[ModelCheckpoint(dirpath=folder, save_top_k=-1, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, _data(), ckpt_path=resume)
    return trainer, model


def _fit_stop_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    _, reference = _fit(f"{root}/reference", 3, async_save=False)
    _fit(f"{root}/run", 2, async_save=True)  # stopped after epoch 2
    files = sorted(os.listdir(f"{root}/run"))
    trainer, resumed = _fit(f"{root}/run", 3, async_save=True, resume=f"{root}/run/last.ckpt")
    io = trainer.strategy.checkpoint_io
    loaded = io.load_checkpoint(f"{root}/run/epoch=1-step=8.ckpt")
    same = [torch.equal(a, b) for a, b in zip(reference.parameters(), resumed.parameters())]
    return {
        "files": files,
        "same": same,
        "global_step": loaded["global_step"],
        "epoch": loaded["epoch"],
        "opt_steps": float(loaded["optimizer_states"][0]["state"][0]["step"]),
        "lr": loaded["lr_schedulers"][0]["_last_lr"],
        "param_keys": sorted(loaded["state_dict"]),
    }


def test_ddp_fit_stop_resume_through_unickpt(tmp_path: Path) -> None:
    out = run_ranks(2, _fit_stop_resume, str(tmp_path))
    for r in out:
        assert r["files"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
        assert r["same"] == [True] * 4  # resumed run ends bit for bit where the reference does
        assert r["global_step"] == 8 and r["epoch"] == 1 and r["opt_steps"] == 8.0
        assert r["lr"] == pytest.approx([1e-2 * 0.9**2])
        assert r["param_keys"] == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    assert (tmp_path / "run" / "last.ckpt" / "COMMIT").is_file()


def _sharded_module() -> Any:
    import lightning as L
    from torch.distributed.fsdp import fully_shard

    class Sharded(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

        def configure_model(self) -> None:
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Sharded()


def _fit_sharded(folder: str, epochs: int, resume: str | None = None) -> Any:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from unickpt.integrations.lightning import UnickptModelParallelStrategy

    model = _sharded_module()
    strategy = UnickptModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=epochs,
        callbacks=[ModelCheckpoint(dirpath=folder, save_top_k=-1, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, _data(), ckpt_path=resume)
    return model


def _fsdp2_fit_stop_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    reference = _fit_sharded(f"{root}/reference", 3)
    _fit_sharded(f"{root}/run", 2)
    resumed = _fit_sharded(f"{root}/run", 3, resume=f"{root}/run/last.ckpt")
    pairs = zip(reference.parameters(), resumed.parameters())
    return {"same": [torch.equal(a.full_tensor(), b.full_tensor()) for a, b in pairs]}


def test_fsdp2_model_parallel_strategy_through_unickpt(tmp_path: Path) -> None:
    out = run_ranks(2, _fsdp2_fit_stop_resume, str(tmp_path))
    assert all(r["same"] == [True] * 4 for r in out)
    assert (tmp_path / "run" / "last.ckpt" / "COMMIT").is_file()
    summary = inspect_checkpoint(tmp_path / "run" / "epoch=1-step=8.ckpt")
    assert summary.world_size == 2  # both ranks wrote their shards
    layouts = {t.key: t.layout for t in summary.tensors}
    assert layouts["state_dict.net.0.weight"] == "dtensor"
    assert "optimizer_0.state.net.0.weight.exp_avg" in layouts
