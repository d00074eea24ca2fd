"""DDP on 2 ranks (keys without 'module.') into a plain model on 1 process, bitwise."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import unickpt
from tests.distributed import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _train_and_save(rank: int, world: int, path: str) -> dict[str, list[float]]:
    model = DistributedDataParallel(_model())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * world + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    unickpt.save(path, {"model": model, "optimizer": opt})
    return {k: v.flatten().tolist() for k, v in model.module.state_dict().items()}


def _load_plain(rank: int, world: int, path: str) -> dict[str, list[float]]:
    model = _model()
    for p in model.parameters():
        p.data.zero_()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    unickpt.load(path, {"model": model, "optimizer": opt})
    assert opt.param_groups[0]["lr"] == 0.01
    assert int(opt.state[model[0].weight]["step"]) == 3
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def test_ddp_to_plain(tmp_path: Path) -> None:
    path = str(tmp_path / "ddp")
    saved = run_ranks(2, _train_and_save, path)[0]
    from unickpt.engine.tensor_reader import CheckpointReader

    names = CheckpointReader(path).keys()
    assert "model.0.weight" in names
    assert _load_plain(0, 1, path) == saved
