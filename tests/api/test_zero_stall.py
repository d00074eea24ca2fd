"""Zero-stall saves hold the values of the moment of the call, or fail loudly; never a mix.

A gated storage holds the background work at the writer lock until the test opens it, so what
the test does in between happens after the call and before the copy, every time.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import unickpt
from tests.distributed import run_ranks, shared_dir
from unickpt.config import get_config
from unickpt.engine import hold
from unickpt.saving.queue import QUEUE
from unickpt.storage import LocalStorage
from unickpt.storage.base import HeldLock

_TORN = r"was changed in place after the zero-stall save was called and before its copy"


class _GatedStorage(LocalStorage):
    """A real folder whose save waits at the writer lock until ``gate`` is set."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.gate = threading.Event()

    def acquire_lock(self) -> HeldLock:
        self.gate.wait(120)
        return super().acquire_lock()


class _Trainer:
    """A training loop object owning its optimizer, as frameworks have: the optimizer is
    nowhere in the state but inside this object's state dict."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return (to_local() if callable(to_local) else t).detach().clone()


def _values(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and the optimizer (local shards), copied."""
    out = {f"model.{k}": _local(v) for k, v in model.state_dict().items()}
    for i, per_param in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": _local(v) for k, v in per_param.items()})
    return out


def _assert_same(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(found[k], v), k


def _bn_model(width: int) -> nn.Module:
    # 20,000 features: the running statistics (80 KB each) are above the small-tensor limit,
    # so they are copied in the call because they are buffers.
    return nn.Sequential(nn.Linear(8, width), nn.BatchNorm1d(width), nn.Linear(width, 4))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(16, 8, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _bn_model(20_000)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, opt, seed)
    return model, opt


def _step_in_thread(opt: torch.optim.Optimizer) -> threading.Thread:
    thread = threading.Thread(target=opt.step)
    thread.start()
    return thread


def test_buffers_hold_their_values_of_the_call_through_a_forward(tmp_path: Path) -> None:
    model, opt = _build(0)
    at_call = _values(model, opt)
    storage = _GatedStorage(tmp_path / "bn")
    fut = unickpt.async_save(storage, {"model": model, "optimizer": opt}, zero_stall=True)
    model(torch.randn(16, 8)).square().mean().backward()  # running stats move now
    assert not torch.equal(model[1].running_mean, at_call["model.1.running_mean"])
    storage.gate.set()
    opt.step()
    fut.wait()
    fresh, fresh_opt = _build(1)
    unickpt.load(tmp_path / "bn", {"model": fresh, "optimizer": fresh_opt})
    _assert_same(_values(fresh, fresh_opt), at_call)


def test_an_optimizer_inside_a_trainer_object_waits_for_the_copy(tmp_path: Path) -> None:
    model, opt = _build(0)
    trainer = _Trainer(opt)
    at_call = _values(model, opt)
    storage = _GatedStorage(tmp_path / "trainer")
    fut = unickpt.async_save(storage, {"model": model, "trainer": trainer}, zero_stall=True)
    model(torch.randn(16, 8)).square().mean().backward()
    step = _step_in_thread(opt)
    step.join(timeout=0.5)
    assert step.is_alive()  # held: the copy has not run yet
    storage.gate.set()
    step.join()
    fut.wait()
    assert not torch.equal(model[0].weight, at_call["model.0.weight"])  # the step ran after
    fresh, fresh_opt = _build(1)
    unickpt.load(tmp_path / "trainer", {"model": fresh, "trainer": _Trainer(fresh_opt)})
    _assert_same(_values(fresh, fresh_opt), at_call)


def test_an_in_place_update_during_the_copy_fails_the_save(tmp_path: Path) -> None:
    model, opt = _build(0)
    unickpt.save(tmp_path / "old", {"model": model})
    at_old = _values(model, opt)
    for name, overwrite in (("new", False), ("old", True)):
        storage = _GatedStorage(tmp_path / name)
        fut = unickpt.async_save(storage, {"model": model}, zero_stall=True, overwrite=overwrite)
        with torch.no_grad():
            model[2].weight.add_(1.0)  # no optimizer: nothing waits for the copy
        storage.gate.set()
        with pytest.raises(unickpt.CheckpointError, match=_TORN) as info:
            fut.wait()
        assert "'model.2.weight'" in str(info.value)
        assert "version counter went from" in str(info.value)
        assert "zero_stall=False" in str(info.value)  # what to do
    assert not (tmp_path / "new" / "COMMIT").exists()
    with pytest.raises(unickpt.CheckpointNotFoundError):
        unickpt.load(tmp_path / "new", {"model": _build(1)[0]})
    fresh, fresh_opt = _build(1)
    unickpt.load(tmp_path / "old", {"model": fresh})  # the earlier checkpoint stays whole
    found = _values(fresh, fresh_opt)
    for k, v in at_old.items():
        if k.startswith("model."):
            assert torch.equal(found[k], v), k


def test_an_update_through_a_view_or_the_base_is_seen(tmp_path: Path) -> None:
    base = torch.zeros(4, 50_000)
    for i, change in enumerate([lambda: base[1].add_(1), lambda: base.mul_(2)]):
        storage = _GatedStorage(tmp_path / f"v{i}")
        fut = unickpt.async_save(storage, {"row": base[1]}, zero_stall=True)
        with torch.no_grad():
            change()
        storage.gate.set()
        with pytest.raises(unickpt.CheckpointError, match=f"'row' {_TORN}"):
            fut.wait()


def test_a_streamed_save_checks_versions_too(tmp_path: Path) -> None:
    """Above the staging budget the write reads the live tensors: the check runs on them."""
    small = get_config(segment_bytes=4096, window_bytes=4096, staging_budget_bytes=4096)
    weight = torch.zeros(100_000)
    storage = _GatedStorage(tmp_path / "s")
    fut = unickpt.async_save(storage, {"w": weight}, zero_stall=True, config=small)
    weight.add_(1.0)
    storage.gate.set()
    with pytest.raises(unickpt.CheckpointError, match=f"'w' {_TORN}"):
        fut.wait()
    assert not (tmp_path / "s" / "COMMIT").exists()


def test_tensors_without_version_counters_and_inside_values_are_copied(tmp_path: Path) -> None:
    with torch.inference_mode():
        frozen = torch.zeros(100_000)
    inner = torch.zeros(100_000)
    state = {
        "frozen": frozen,
        "pair": (inner, 3),
        "rng": unickpt.PerRank(torch.zeros(8, dtype=torch.uint8)),
    }
    storage = _GatedStorage(tmp_path / "c")
    fut = unickpt.async_save(storage, state, zero_stall=True)
    with torch.inference_mode():
        frozen.add_(1)
    inner.add_(1)
    state["rng"].value.add_(1)
    storage.gate.set()
    fut.wait()
    dest = {"frozen": torch.ones(100_000), "pair": None, "rng": unickpt.PerRank(None)}
    unickpt.load(tmp_path / "c", dest)
    assert torch.equal(dest["frozen"], torch.zeros(100_000))
    assert torch.equal(dest["pair"][0], torch.zeros(100_000)) and dest["pair"][1] == 3
    assert torch.equal(dest["rng"].value, torch.zeros(8, dtype=torch.uint8))


def test_finished_saves_leave_the_pending_list(tmp_path: Path) -> None:
    model, opt = _build(0)
    state = {"model": model, "optimizer": opt}
    unickpt.wait_pending()
    for i in range(12):
        fut = unickpt.async_save(tmp_path / f"p{i}", state, zero_stall=True)
        assert len(QUEUE.pending()) <= 1  # this save, unless it is already done
        assert len(hold._HELD) <= 1
        _train_step(model, opt, i)
        fut.wait()
    assert hold.held() == []


def _fsdp2_zero_stall(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = _bn_model(256)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        _train_step(model, opt, seed)
        return model, opt

    model, opt = build(0)
    # A forward after the call, and a step of an optimizer held only by a trainer object.
    at_call = _values(model, opt)
    storage = _GatedStorage(f"{root}/held")
    fut = unickpt.async_save(storage, {"model": model, "trainer": _Trainer(opt)}, zero_stall=True)
    model(torch.randn(16, 8)).square().mean().backward()
    step = _step_in_thread(opt)
    step.join(timeout=0.5)
    assert step.is_alive()
    storage.gate.set()
    step.join()
    fut.wait()
    fresh, fresh_opt = build(1)
    unickpt.load(f"{root}/held", {"model": fresh, "trainer": _Trainer(fresh_opt)})
    _assert_same(_values(fresh, fresh_opt), at_call)

    # An in-place update of a DTensor parameter on rank 1 only: every rank fails.
    opt.zero_grad()
    storage = _GatedStorage(f"{root}/torn")
    fut = unickpt.async_save(storage, {"model": model}, zero_stall=True)
    if rank == 1:
        with torch.no_grad():
            model[2].weight.add_(1.0)
    dist.barrier()
    storage.gate.set()
    with pytest.raises(unickpt.CheckpointError, match=f"rank 1: .*'model.2.weight' {_TORN}"):
        fut.wait()
    assert not Path(f"{root}/torn/COMMIT").exists()


def test_fsdp2_zero_stall_on_two_ranks(tmp_path: Path) -> None:
    run_ranks(2, _fsdp2_zero_stall, shared_dir(tmp_path, "ckpt"))


def test_the_former_name_of_zero_stall_still_works_and_names_it(tmp_path: Path) -> None:
    model, opt = _build(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(DeprecationWarning, match="pass zero_stall=... instead"):
        fut = unickpt.async_save(tmp_path / "c", {"model": model}, background_snapshot=True)
    _train_step(model, opt, 0)  # waits for the copy, as a zero-stall save's step does
    fut.wait()
    loaded, _ = _build(1)
    unickpt.load(tmp_path / "c", {"model": loaded})
    for k, v in before.items():
        assert torch.equal(loaded.state_dict()[k], v), k
