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
    from unickpt.saving.queue import QUEUE

    assert QUEUE.arena._pinned
    for path in ("s", "a"):
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        unickpt.load(tmp_path / path, dest)
        for k in dest:
            assert torch.equal(dest[k], expected[k]), (path, k)
    cpu = {"w": torch.zeros(1024, 1024), "b": torch.zeros(7)}
    unickpt.load(tmp_path / "a", cpu)
    assert torch.equal(cpu["w"], expected["w"].cpu())


def test_cuda_zero_stall_holds_the_values_of_the_call(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the caller's kernels run on a stream of its own
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        opt.step()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        fut = unickpt.async_save(tmp_path / "z", {"model": model}, zero_stall=True)
        model(torch.randn(8, 256, device="cuda")).sum().backward()  # moves the BN statistics
        opt.step()  # waits for the copy
    fut.wait()
    dest = {k: torch.zeros_like(v) for k, v in expected.items()}
    unickpt.load(tmp_path / "z", {"model": dest})
    for k, v in expected.items():
        assert torch.equal(dest[k], v), k


def test_cuda_state_through_a_bounded_pinned_ring(tmp_path: Path) -> None:
    from unickpt.saving.queue import QUEUE

    g = torch.Generator(device="cuda").manual_seed(3)
    state = {
        "w": torch.randn(2048, 2048, device="cuda", generator=g),  # 16 MiB
        "t": torch.randn(1024, 1536, device="cuda", generator=g).t(),  # not contiguous
        "h": torch.randn(3000, device="cuda", generator=g).half(),
    }
    expected = {k: v.clone() for k, v in state.items()}
    QUEUE.arena.release()
    for background in (False, True):
        path = tmp_path / f"r{background}"
        fut = unickpt.async_save(path, state, staging_bytes=4 << 20, zero_stall=background)
        fut.wait()
        assert QUEUE.arena._pinned and QUEUE.arena.capacity_bytes == 4 << 20
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        unickpt.load(tmp_path / f"r{background}", dest)
        for k in dest:
            assert torch.equal(dest[k], expected[k]), (background, k)
    QUEUE.arena.release()
