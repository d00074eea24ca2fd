"""What a training script puts in a state: tied weights, optimizer state dicts, optimizer
containers, and loads that skip part of a checkpoint (strict=False)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from unickpt.engine.tensor_reader import CheckpointReader


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight, as GPT-2 has them."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tied_weights_are_saved_once_and_restored_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    unickpt.save(tmp_path / "c", {"model": model})
    with CheckpointReader(tmp_path / "c") as reader:
        meta = reader.metadata
        assert meta.aliases == {"model.lm_head.weight": "model.wte.weight"}
        assert "model.lm_head.weight" not in meta.tensors
        assert meta.total_bytes == (10 * 4 + 4 * 4 + 4) * 4  # the shared weight once
        assert torch.equal(reader.read_tensor("model.lm_head.weight"), model.wte.weight)
        assert "model.lm_head.weight" in reader.keys()  # noqa: SIM118 - a method, not a dict

    torch.manual_seed(1)
    tied = TiedLM()
    unickpt.load(tmp_path / "c", {"model": tied})
    assert tied.lm_head.weight is tied.wte.weight
    assert _same(tied.state_dict(), model.state_dict())

    untied = TiedLM(tied=False)
    unickpt.load(tmp_path / "c", {"model": untied})
    assert _same(untied.state_dict(), model.state_dict())


def test_untied_checkpoint_loads_into_tied_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    untied = TiedLM(tied=False)
    with torch.no_grad():
        untied.lm_head.weight.copy_(untied.wte.weight)
    unickpt.save(tmp_path / "c", {"model": untied})
    tied = TiedLM()
    unickpt.load(tmp_path / "c", {"model": tied})
    assert tied.lm_head.weight is tied.wte.weight
    assert _same(tied.state_dict(), untied.state_dict())


def test_tied_model_with_its_optimizer_resumes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.lm_head(model.body(model.wte(torch.tensor([1, 2])))).sum().backward()
    opt.step()
    unickpt.save(tmp_path / "c", {"model": model, "optim": opt})
    torch.manual_seed(1)
    again = TiedLM()
    opt2 = torch.optim.AdamW(again.parameters(), lr=0.1)
    unickpt.load(tmp_path / "c", {"model": again, "optim": opt2})
    assert _same(again.state_dict(), model.state_dict())
    saved, loaded = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(_same(saved[i], loaded[i]) for i in saved) and saved.keys() == loaded.keys()


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return model, opt


def test_plain_optimizer_state_dict_loads_into_the_same_layout(tmp_path: Path) -> None:
    model, opt = _trained()
    unickpt.save(tmp_path / "c", {"model": model, "optim": opt.state_dict()})
    model2, opt2 = _trained(seed=5)
    state = {"model": model2, "optim": opt2.state_dict()}
    unickpt.load(tmp_path / "c", state)
    opt2.load_state_dict(state["optim"])
    want, got = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert want.keys() == got.keys() and all(_same(want[i], got[i]) for i in want)


def test_plain_optimizer_state_dict_elsewhere_says_to_pass_the_optimizer(tmp_path: Path) -> None:
    model, opt = _trained()
    unickpt.save(tmp_path / "c", {"model": model, "optim": opt.state_dict()})
    hint = (
        "'optim' holds an optimizer state dict keyed by parameter number "
        "(optimizer.state_dict()), which loads only into the same layout; put the optimizer "
        "object itself in the state ({'optim': optimizer})"
    )
    fresh = torch.optim.Adam(nn.Linear(4, 3).parameters())  # no state yet: another layout
    with pytest.raises(unickpt.CheckpointMismatchError) as info:
        unickpt.load(tmp_path / "c", {"optim": fresh.state_dict()})
    assert "the state has keys the checkpoint lacks: 'optim.state'" in str(info.value)
    assert hint in str(info.value)
    other = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 4))  # parameters numbered otherwise
    other_opt = torch.optim.Adam(other.parameters())
    other(torch.ones(1, 2)).sum().backward()
    other_opt.step()
    with pytest.raises(unickpt.CheckpointMismatchError) as info:
        unickpt.load(tmp_path / "c", {"optim": other_opt.state_dict()})
    assert (
        "'optim.state.0.exp_avg' has global shape [3, 4] in the checkpoint but [3, 2] in the state"
        in str(info.value)
    )
    assert hint in str(info.value)


class OptimizersContainer(torch.optim.Optimizer):
    """One optimizer per model part behind one object, with a state dict keyed by parameter
    names (as torchtitan's ``OptimizersContainer``)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=0.1) for p in parts]
        torch.optim.Optimizer.__init__(self, [p for m in parts for p in m.parameters()], {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for opt in self.optimizers:
            opt.step()

    def _named(self) -> list[tuple[str, torch.optim.Optimizer, torch.Tensor]]:
        return [
            (f"part{i}.{name}", opt, p)
            for i, (part, opt) in enumerate(zip(self.parts, self.optimizers))
            for name, p in part.named_parameters()
        ]

    def state_dict(self) -> dict[str, Any]:
        if not any(opt.state for opt in self.optimizers):
            for _, _, p in self._named():
                p.grad = torch.zeros_like(p)
            for opt in self.optimizers:
                opt.param_groups[0]["lr"], lr = 0.0, opt.param_groups[0]["lr"]
                opt.step()
                opt.param_groups[0]["lr"] = lr
        out: dict[str, Any] = {}
        for name, opt, p in self._named():
            for k, v in opt.state[p].items():
                out[f"state.{name}.{k}"] = v
        for i, opt in enumerate(self.optimizers):
            out[f"lr.{i}"] = opt.param_groups[0]["lr"]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, opt, p in self._named():
            for k in opt.state[p]:
                opt.state[p][k].copy_(state_dict[f"state.{name}.{k}"])
        for i, opt in enumerate(self.optimizers):
            opt.param_groups[0]["lr"] = state_dict[f"lr.{i}"]


def test_optimizer_with_its_own_state_dict_format_is_a_plain_object(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    parts = [nn.Linear(3, 3), nn.Linear(3, 2)]
    container = OptimizersContainer(parts)
    parts[1](parts[0](torch.ones(1, 3))).sum().backward()
    container.step()
    container.optimizers[1].param_groups[0]["lr"] = 0.05
    with caplog.at_level(logging.WARNING):
        unickpt.save(tmp_path / "c", {"parts": parts, "optim": container})
    torch.manual_seed(1)
    parts2 = [nn.Linear(3, 3), nn.Linear(3, 2)]
    container2 = OptimizersContainer(parts2)
    with caplog.at_level(logging.WARNING):
        unickpt.load(tmp_path / "c", {"parts": parts2, "optim": container2})
    assert "keyed by position" not in caplog.text
    want, got = container.state_dict(), container2.state_dict()
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k], k
    with CheckpointReader(tmp_path / "c") as reader:
        assert "optim.state.part1.weight.exp_avg" in reader.keys()  # noqa: SIM118 - a method, not a dict


def test_strict_false_reports_what_it_did_not_load(tmp_path: Path) -> None:
    saved = {"model": {"a": torch.ones(3), "b": torch.ones(2, 2), "head": torch.ones(3)}}
    unickpt.save(tmp_path / "c", saved)
    dest = {"model": {"a": torch.zeros(3), "c": torch.zeros(1), "head": torch.zeros(5)}}
    with pytest.raises(unickpt.CheckpointMismatchError) as info:
        unickpt.load(tmp_path / "c", dest)
    assert "the state has keys the checkpoint lacks: 'model.c'" in str(info.value)
    assert "'model.head' has global shape [3] in the checkpoint but [5] in the state" in str(
        info.value
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = unickpt.load(tmp_path / "c", dest, strict=False)
    assert [str(w.message) for w in caught] == [
        "strict=False: 'model': 1 tensor (16 B) not loaded (not in the state): "
        "'model.b'; 'model': 1 tensor (12 B) not loaded (shape differs): 'model.head'; "
        "1 key of this rank's state is not in the checkpoint and keeps its current value: "
        "'model.c'"
    ]
    assert torch.equal(dest["model"]["a"], torch.ones(3))
    assert torch.equal(dest["model"]["head"], torch.zeros(5))
    assert report.skipped_keys == ("model.c", "model.head")
    assert report.unread_keys == ("model.b",)
