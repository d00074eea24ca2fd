"""A small transformer under FSDP2 with AdamW: resume on 2 ranks bit for bit, on 1 and 4 closely."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unickpt
from tests.distributed import run_ranks

GLOBAL_BATCH, SEQ, VOCAB, DIM = 8, 16, 50, 32
SAVE_AT, STEPS = 3, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _build(seed: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT()
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    mine = data[rank * per : (rank + 1) * per]
    logits = model(mine[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.detach().clone()
    if world > 1:
        dist.all_reduce(value)
        value /= world
    return float(value)


def _reference(rank: int, world: int, path: str) -> list[float]:
    model, opt = _build(0, world)
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            unickpt.save(path, {"model": model, "optimizer": opt, "train": {"step": step}})
        losses.append(_step(model, opt, step, rank, world))
    return losses


def _resume(rank: int, world: int, path: str) -> list[float]:
    model, opt = _build(99, world)
    state = {"model": model, "optimizer": opt, "train": {"step": 0}}
    unickpt.load(path, state)
    start = state["train"]["step"]
    return [_step(model, opt, s, rank, world) for s in range(start, STEPS)]


def _reference_and_resume(rank: int, world: int, path: str) -> tuple[list[float], list[float]]:
    """The reference run, then a resume from its checkpoint in the same ranks: a new model and
    optimizer (other initial values) that get everything from the checkpoint on disk."""
    return _reference(rank, world, path), _resume(rank, world, path)


def test_fsdp2_resume_on_2_1_and_4_ranks(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    reference, same = run_ranks(2, _reference_and_resume, path)[0]
    expected = reference[SAVE_AT:]
    assert same == expected, (same, expected)
    for world in (1, 4):
        got = run_ranks(world, _resume, path)[0]
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=1e-5), (
            world,
            got,
            expected,
        )
