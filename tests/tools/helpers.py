"""Sample checkpoints for the tool tests, and bitwise comparisons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import unickpt
from unickpt.engine.tensor_reader import CheckpointReader
from unickpt.tools import inspect_checkpoint
from unickpt.tools.selection import nest_top_level


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def make_tied_model(seed: int = 0, tied: bool = True) -> torch.nn.Module:
    """An embedding and an output head sharing one weight (``head.weight`` is ``wte.weight``)."""
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"wte": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5)})
    if tied:
        model["head"].weight = model["wte"].weight
    return model


def sample_state(seed: int = 0) -> dict[str, Any]:
    """A model, a trained optimizer, tensors of several dtypes and shapes, and plain values."""
    model = make_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "model": model,
        "optimizer": optimizer,
        "step": 12,
        "train": {"name": "run-a", "betas": (0.9, 0.95), "history": [1.5, float("inf")]},
        "buffers": {
            "big": torch.randn(257, 129, generator=g),
            "half": torch.randn(7, 5, generator=g).to(torch.bfloat16),
            "ids": torch.arange(11, dtype=torch.int64),
            "mask": torch.arange(9).reshape(3, 3) % 2 == 0,
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 4),
        },
    }


def save_sample(path: Path, seed: int = 0) -> dict[str, Any]:
    state = sample_state(seed)
    unickpt.save(path, state)
    return state


def reader_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a unickpt checkpoint by dotted key."""
    with CheckpointReader(path) as reader:
        return {k: reader.read_tensor(k) for k in reader.metadata.tensors}


def empty_like_checkpoint(path: Path, nested: bool = True) -> dict[str, Any]:
    """Zero tensors with the checkpoint's keys, shapes and dtypes (nested by first component)."""
    summary = inspect_checkpoint(path)
    flat = {t.key: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in summary.tensors}
    return nest_top_level(flat) if nested else flat


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, key: str = "") -> None:
    assert actual.dtype == expected.dtype, (key, actual.dtype, expected.dtype)
    assert tuple(actual.shape) == tuple(expected.shape), (key, actual.shape, expected.shape)
    a = actual.detach().contiguous().reshape(-1).view(torch.uint8)
    b = expected.detach().contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a, b), key


def save_two_ranks(rank: int, world: int, path: str) -> None:
    """Rank r holds rows [4r, 4r + 4) of an 8x6 tensor; a bias is replicated; a value per rank."""
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    state = {
        "model": {
            "w": unickpt.ShardedTensor(
                full[4 * rank : 4 * rank + 4].clone(), (8, 6), (4 * rank, 0)
            ),
            "b": torch.ones(6),
        },
        "data_position": unickpt.PerRank(100 + rank),
        "step": 3,
    }
    unickpt.save(path, state)


def plain_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": make_model(seed).state_dict(),
        "extra": {
            "ema": torch.randn(5, 4, generator=g).to(torch.bfloat16),
            "count": torch.tensor(3),
        },
        "step": 42,
        "name": "run-b",
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = zeros_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        if isinstance(v, dict):
            assert_same(actual[k], v)
        elif isinstance(v, torch.Tensor):
            assert_bitwise(actual[k], v, k)
        else:
            assert actual[k] == v, k
