"""What a zero-stall save captures in the call: keys as flattening makes them, copies, versions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from unickpt.planning.capture import COPY_IN_CALL_BYTES, Captured, capture
from unickpt.planning.flatten import flatten_state


class _Holder:
    """A stateful object that owns a module (its buffers are buffers too) and nested state."""

    def __init__(self) -> None:
        self.norm = nn.BatchNorm1d(20_000)
        self.table = torch.zeros(50_000)

    def state_dict(self) -> dict[str, Any]:
        return {"norm": self.norm.state_dict(), "nested": {"table": self.table, "ids": [1, 2]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _state() -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(128, 256), nn.BatchNorm1d(256), nn.Linear(256, 128))
    model[2].weight = nn.Parameter(torch.randn(128, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    big = torch.randn(40_000)
    return {
        "model": model,
        "optimizer": opt,
        "holder": _Holder(),
        "lists": [big, {"inner": torch.zeros(3)}],
        "tied": {"a": big, "b": big},
        "block": unickpt.ShardedTensor(torch.zeros(200, 100), (400, 100), (200, 0)),
        "flat": unickpt.FlatShard(torch.zeros(10), (4, 6), 7),
        "value": (torch.zeros(2), "x", {"loss": torch.ones(2, requires_grad=True) * 2}),
        "rng": unickpt.PerRank(torch.zeros(4, dtype=torch.uint8)),
        "empty": {},
        "step": 3,
    }


def test_every_tensor_key_is_watched_or_copied_exactly_as_flattening_names_it() -> None:
    state = _state()
    cap = capture(state)
    flat = flatten_state(cap.state)
    assert set(flat.aliases) == {"tied.a", "tied.b"}  # "lists.0" is the same tensor, met first
    assert set(flat.tensors) | set(flat.aliases) == set(cap.watched) | cap.copied
    assert not set(cap.watched) & cap.copied
    assert set(cap.watched) == {
        "model.0.weight",
        "model.2.weight",
        "optimizer.state.0.weight.exp_avg",
        "optimizer.state.0.weight.exp_avg_sq",
        "optimizer.state.2.weight.exp_avg",
        "optimizer.state.2.weight.exp_avg_sq",
        "holder.norm.weight",  # parameters of 80 KB: kept, watched
        "holder.norm.bias",
        "holder.nested.table",
        "lists.0",
        "tied.a",
        "tied.b",
        "block",
    }
    for key in cap.watched:
        cap.check(key)  # nothing moved yet


def test_buffers_small_tensors_and_values_are_copied_large_ones_kept() -> None:
    state = _state()
    cap = capture(state)
    model = cap.state["model"]
    assert isinstance(model, Captured)
    taken = model.state_dict()
    assert taken["0.weight"] is state["model"][0].weight  # by reference, watched
    assert taken["0.bias"] is not state["model"][0].bias  # small: copied
    assert torch.equal(taken["0.bias"], state["model"][0].bias)
    assert taken["1.running_mean"] is not state["model"][1].running_mean  # a buffer
    holder = cap.state["holder"].state_dict()
    assert holder["norm"]["running_var"] is not state["holder"].norm.running_var
    assert holder["norm"]["running_var"].nbytes > COPY_IN_CALL_BYTES  # copied as a buffer
    assert cap.state["tied"]["a"] is cap.state["tied"]["b"] is state["tied"]["a"]
    assert cap.state["value"][0] is not state["value"][0]  # inside a value: deep-copied
    assert torch.equal(cap.state["value"][2]["loss"], torch.full((2,), 2.0))
    assert cap.state["rng"].value is not state["rng"].value
    assert cap.state["flat"].local is not state["flat"].local  # a small shard
    assert cap.state["block"] is state["block"]


def test_check_names_the_key_of_a_tensor_changed_in_place() -> None:
    state = _state()
    cap = capture(state)
    with torch.no_grad():
        state["model"][2].weight.mul_(2)
    cap.check("model.0.weight")
    with pytest.raises(unickpt.CheckpointError, match=r"'model\.2\.weight' was changed in place"):
        cap.check("model.2.weight")
    state["block"].local[0, 0] = 1.0  # through a view of the block
    with pytest.raises(unickpt.CheckpointError, match="'block' was changed in place"):
        cap.check("block")


def test_a_value_that_cannot_be_copied_is_refused_in_the_call() -> None:
    import threading

    with pytest.raises(unickpt.CheckpointError, match="'lock' holds a lock that cannot be copied"):
        capture({"lock": threading.Lock()})
