"""Asynchronous saves: the checkpoint holds the values of the moment of the call."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks

import unickpt
from unickpt.engine import hold
from unickpt.storage import LocalStorage
from unickpt.storage.base import WriteHandle


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _saved(path: Path) -> dict[str, torch.Tensor]:
    model, _ = _model()
    for p in model.parameters():
        p.data.zero_()
    unickpt.load(path, {"model": model}, strict=False)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_async_save_holds_values_at_snapshot(tmp_path: Path) -> None:
    model, opt = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fut = unickpt.async_save(tmp_path / "a", {"model": model, "optimizer": opt})
    fut.wait_snapshot()
    for _ in range(3):
        _train(model, opt)
    fut.wait()
    assert fut.done() and fut.durable_s is not None
    saved = _saved(tmp_path / "a")
    for k, v in before.items():
        assert torch.equal(saved[k], v), k
        assert not torch.equal(model.state_dict()[k], v)


def test_zero_stall_waits_for_next_optimizer_step(tmp_path: Path) -> None:
    model, opt = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(3):
        fut = unickpt.async_save(
            tmp_path / f"z{i}", {"model": model, "optimizer": opt}, zero_stall=True
        )
        _train(model, opt)  # forward and backward overlap the snapshot; step() waits for it
        fut.wait()
        saved = _saved(tmp_path / f"z{i}")
        for k, v in before.items():
            assert torch.equal(saved[k], v), (i, k)
        before = {k: v.clone() for k, v in model.state_dict().items()}


def test_zero_stall_saves_back_to_back_then_several_steps(tmp_path: Path) -> None:
    """Two saves before a step, then steps: the step waits for both, later steps do not."""
    model, _ = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"model": model, "optimizer": opt}
    first = unickpt.async_save(tmp_path / "b0", state, zero_stall=True)
    second = unickpt.async_save(tmp_path / "b1", state, zero_stall=True)
    for _ in range(3):
        _train(model, opt)
    assert first.snapshot_done() and second.snapshot_done()
    first.wait()
    second.wait()
    for name in ("b0", "b1"):
        saved = _saved(tmp_path / name)
        for k, v in before.items():
            assert torch.equal(saved[k], v), (name, k)
    unickpt.async_save(tmp_path / "b2", state, zero_stall=True).wait()
    assert not opt._optimizer_step_pre_hooks  # one global hook holds every optimizer
    ours = [h for h in _global_optimizer_pre_hooks.values() if h.__module__ == hold.__name__]
    assert len(ours) == 1
    assert hold.held() == []


class _Loader:
    """A data loader's position: it advances in forward, before the optimizer step."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_zero_stall_captures_everything_but_tensor_values_in_the_call(tmp_path: Path) -> None:
    model, opt = _model()
    loader = _Loader()
    loader.position = 7
    state = {"model": model, "optimizer": opt, "loader": loader, "step": 5, "tags": ["a"]}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fut = unickpt.async_save(tmp_path / "c", state, zero_stall=True)
    state["step"] = 6  # the loop moves on at once; the checkpoint keeps the call's values
    state["tags"].append("b")
    loader.position = 8
    _train(model, opt)
    fut.wait()
    fresh_model, fresh_opt = _model()
    fresh = {"model": fresh_model, "optimizer": fresh_opt, "loader": _Loader(), "step": 0}
    fresh["tags"] = []
    unickpt.load(tmp_path / "c", fresh)
    assert (fresh["step"], fresh["tags"], fresh["loader"].position) == (5, ["a"], 7)
    for k, v in before.items():
        assert torch.equal(fresh_model.state_dict()[k], v), k


def test_zero_stall_planning_error_surfaces_in_wait(tmp_path: Path) -> None:
    model, opt = _model()
    unickpt.save(tmp_path / "c", {"model": model})
    fut = unickpt.async_save(tmp_path / "c", {"model": model, "optimizer": opt}, zero_stall=True)
    _train(model, opt)  # the guarded step does not hang on a save that failed
    with pytest.raises(unickpt.CheckpointExistsError, match="already holds a committed"):
        fut.wait()
    unickpt.load(tmp_path / "c", {"model": _model()[0]})  # the old checkpoint is intact


def test_saves_are_ordered_and_reuse_staging(tmp_path: Path) -> None:
    from unickpt.saving.queue import QUEUE

    model, opt = _model()
    futures = []
    for i in range(4):
        futures.append(unickpt.async_save(tmp_path / f"s{i}", {"model": model, "i": i}))
        capacity = QUEUE.arena.capacity_bytes
        _train(model, opt)
    for f in futures:
        f.wait()
    assert QUEUE.arena.capacity_bytes == capacity


class _FailingStorage(LocalStorage):
    """A backend whose data writes fail, as a full or broken device would."""

    def create(self, name: str, nbytes: int) -> WriteHandle:
        raise unickpt.CheckpointError(f"writing {name} failed: the device is gone")


def test_wait_reraises_background_failure_with_traceback(tmp_path: Path) -> None:
    model, _ = _model()
    fut = unickpt.async_save(_FailingStorage(tmp_path / "f"), {"model": model})
    with pytest.raises(unickpt.CheckpointError, match="the device is gone") as info:
        fut.wait()
    frames = "".join(traceback.format_tb(info.value.__traceback__))
    assert "write_and_commit" in frames
    with pytest.raises(unickpt.CheckpointNotFoundError):
        unickpt.load(tmp_path / "f", {"model": model})


def test_async_mixed_dtypes_and_layouts(tmp_path: Path) -> None:
    base = torch.arange(30, dtype=torch.float64).reshape(5, 6)
    state = {
        "a_bool": torch.tensor([True, False, True]),
        "b_complex": torch.randn(5, dtype=torch.complex128),
        "c_int8": torch.arange(7, dtype=torch.int8),
        "d_strided": base.t(),
        "e_bf16": torch.randn(9).to(torch.bfloat16),
        "f_big": torch.randn(600_000),
    }
    fut = unickpt.async_save(tmp_path / "m", state)
    fut.wait()
    dest = {k: torch.zeros_like(v.contiguous()) for k, v in state.items()}
    unickpt.load(tmp_path / "m", dest)
    for k, v in state.items():
        assert torch.equal(dest[k], v), k


def test_large_tensors_changed_after_the_call_are_saved_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large host tensors are copied on torch's intra-op threads where they fit the cores;
    either way the copy is done when ``async_save`` returns."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(512, 1024, generator=g)
    state = {"big": torch.randn(3 << 20, generator=g), "wide_t": wide.t(), "small": torch.ones(8)}
    before = {k: v.clone() for k, v in state.items()}
    fut = unickpt.async_save(tmp_path / "c", state)
    for v in state.values():
        v.mul_(-2)  # the next training step, right after the call
    fut.wait()
    dest = {k: torch.zeros_like(v.contiguous()) for k, v in state.items()}
    unickpt.load(tmp_path / "c", dest)
    for k, v in before.items():
        assert torch.equal(dest[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k
