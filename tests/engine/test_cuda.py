"""The CUDA path: CUDA tensors in the state, pinned staging, asynchronous copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unickpt

pytestmark = pytest.mark.gpu


def test_cuda_state_sync_and_async_roundtrip(tmp_path: Path) -> None:
    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda")}
    unickpt.save(tmp_path / "s", state)
    fut = unickpt.async_save(tmp_path / "a", state)
    fut.wait_snapshot()
    expected = {k: v.clone() for k, v in state.items()}
    state["w"].add_(1)
    fut.wait()
    from unickpt.engine.staging import ARENA

    assert ARENA._pinned
    for path in ("s", "a"):
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        unickpt.load(tmp_path / path, dest)
        for k in dest:
            assert torch.equal(dest[k], expected[k]), (path, k)
    cpu = {"w": torch.zeros(1024, 1024), "b": torch.zeros(7)}
    unickpt.load(tmp_path / "a", cpu)
    assert torch.equal(cpu["w"], expected["w"].cpu())
