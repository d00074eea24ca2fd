"""UnickptCheckpointIO under Lightning's Trainer: DDP on 2 CPU processes, fit, stop, resume."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning", reason="needs Lightning: pip install 'unickpt[lightning]'")

from tests.distributed import run_ranks
from unickpt.errors import CheckpointNotFoundError
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


def _fit(
    folder: str, epochs: int, async_save: bool, resume: str | None = None, unickpt: bool = True
) -> Any:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from unickpt.integrations.lightning import UnickptCheckpointIO

    model = _module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=epochs,
        plugins=[UnickptCheckpointIO(async_save=async_save)] if unickpt else [],
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
    _fit(f"{root}/run", 2, async_save=True, resume="last")  # a first run; stopped after epoch 2
    files = sorted(os.listdir(f"{root}/run"))
    trainer, resumed = _fit(f"{root}/run", 3, async_save=True, resume="last")  # resumes
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


def test_ddp_fit_stop_resume_through_unickpt(runs: Runs) -> None:
    tmp_path, out = runs["ddp"]
    for r in out:
        assert r["files"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
        assert r["same"] == [True] * 4  # resumed run ends bit for bit where the reference does
        assert r["global_step"] == 8 and r["epoch"] == 1 and r["opt_steps"] == 8.0
        assert r["lr"] == pytest.approx([1e-2 * 0.9**2])
        assert r["param_keys"] == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    assert (tmp_path / "run" / "last.ckpt" / "COMMIT").is_file()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _resume_from_torch_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """A run before the switch wrote torch.save files; the run with the plugin resumes one."""
    os.environ["LOCAL_RANK"] = str(rank)
    _, reference = _fit(f"{root}/run", 3, async_save=False, unickpt=False)
    before = {name: os.path.isfile(f"{root}/run/{name}") for name in os.listdir(f"{root}/run")}
    records = _Records()
    logger = logging.getLogger("unickpt.integrations.lightning")
    logger.addHandler(records)
    old = f"{root}/run/epoch=1-step=8.ckpt"
    try:
        _, resumed = _fit(f"{root}/run", 3, async_save=True, resume=old)
    finally:
        logger.removeHandler(records)
    same = [torch.equal(a, b) for a, b in zip(reference.parameters(), resumed.parameters())]
    after = {name: os.path.isdir(f"{root}/run/{name}") for name in os.listdir(f"{root}/run")}
    return {"same": same, "warnings": records.messages, "before": before, "after": after}


def test_fit_resumes_a_torch_save_checkpoint_with_a_warning(runs: Runs) -> None:
    tmp_path, out = runs["torch_save"]
    old = tmp_path / "run" / "epoch=1-step=8.ckpt"
    for r in out:
        assert r["same"] == [True] * 4  # resumed from the torch.save file, bit for bit
        assert r["warnings"] == [
            f"{old} is a torch.save checkpoint, not a unickpt checkpoint folder: loading it "
            "with Lightning's TorchCheckpointIO; the next save at this name is a unickpt "
            "checkpoint"
        ]
        names = ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]
        assert r["before"] == dict.fromkeys(names, True)  # files, written by torch.save
    # the resumed run wrote its epoch (Lightning gives the taken name a version) and its last
    # checkpoint (over the file) as unickpt folders
    folders = ["epoch=2-step=12-v1.ckpt", "last.ckpt"]
    assert out[0]["after"] == {**dict.fromkeys(names[:3], False), **dict.fromkeys(folders, True)}


def test_load_refuses_what_is_no_checkpoint_with_what_it_found(tmp_path: Path) -> None:
    from unickpt.integrations.lightning import UnickptCheckpointIO

    io = UnickptCheckpointIO()
    junk = tmp_path / "notes.ckpt"
    junk.write_text("a text file")
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"notes.ckpt is not a unickpt checkpoint: it is a file, and not one torch.save",
    ):
        io.load_checkpoint(junk)
    dcp = tmp_path / "dcp.ckpt"  # a folder of another format
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    (dcp / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"dcp.ckpt is not a unickpt checkpoint: it has no COMMIT marker \(found .metadata",
    ):
        io.load_checkpoint(dcp)
    with pytest.raises(CheckpointNotFoundError, match=r"nothing is at .*missing.ckpt; expected"):
        io.load_checkpoint(tmp_path / "missing.ckpt")


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


def test_fsdp2_model_parallel_strategy_through_unickpt(runs: Runs) -> None:
    tmp_path, out = runs["fsdp2"]
    assert all(r["same"] == [True] * 4 for r in out)
    assert (tmp_path / "run" / "last.ckpt" / "COMMIT").is_file()
    summary = inspect_checkpoint(tmp_path / "run" / "epoch=1-step=8.ckpt")
    assert summary.world_size == 2  # both ranks wrote their shards
    layouts = {t.key: t.layout for t in summary.tensors}
    assert layouts["state_dict.net.0.weight"] == "dtensor"
    assert "optimizer_0.state.net.0.weight.exp_avg" in layouts


# The jobs of the tests above, one after the other in the same 2 ranks, each in its folder:
# starting ranks that import Lightning took most of a job's time.
JOBS = {
    "ddp": _fit_stop_resume,
    "torch_save": _resume_from_torch_save,
    "fsdp2": _fsdp2_fit_stop_resume,
}
Runs = dict[str, tuple[Path, list[dict[str, Any]]]]


def _every_job(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    return {name: job(rank, world, f"{root}/{name}") for name, job in JOBS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Each job's folder and its ranks' results."""
    root = tmp_path_factory.mktemp("lightning")
    out = run_ranks(2, _every_job, str(root), timeout_s=900)
    return {name: (root / name, [r[name] for r in out]) for name in JOBS}
