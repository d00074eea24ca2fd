from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from unickpt.errors import UnsafeObjectError
from unickpt.integrations.nested import load_nested, save_nested


def test_any_nesting_round_trips(tmp_path: Path) -> None:
    obj = {
        "state_dict": {"layer.weight": torch.arange(6.0).view(2, 3), "layer.bias": torch.ones(2)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}],
        "loops": {"epoch": 2, "ratio": float("nan"), "pair": (1, "a"), "nothing": None},
        (1, 2): [True, 0.5],
        "layer": {"weight": torch.zeros(1)},  # its path clashes with "layer.weight" above
    }
    save_nested(tmp_path / "c", obj)
    back = load_nested(tmp_path / "c")
    assert torch.equal(back["state_dict"]["layer.weight"], obj["state_dict"]["layer.weight"])
    assert torch.equal(back["state_dict"]["layer.bias"], torch.ones(2))
    assert torch.equal(back["optimizer_states"][0]["state"][0]["step"], torch.tensor(3.0))
    assert back["loops"]["pair"] == (1, "a") and back["loops"]["nothing"] is None
    assert back["loops"]["epoch"] == 2 and back["loops"]["ratio"] != back["loops"]["ratio"]
    assert back[(1, 2)] == [True, 0.5]
    assert torch.equal(back["layer"]["weight"], torch.zeros(1))


def test_objects_need_pickle(tmp_path: Path) -> None:
    obj = {"hyper_parameters": {"args": argparse.Namespace(lr=0.1)}}
    with pytest.raises(UnsafeObjectError, match=r"'hyper_parameters.args' .*Namespace"):
        save_nested(tmp_path / "c", obj)
    save_nested(tmp_path / "c", obj, allow_pickle=True)
    with pytest.raises(UnsafeObjectError, match="pickled objects"):
        load_nested(tmp_path / "c")
    assert load_nested(tmp_path / "c", allow_pickle=True)["hyper_parameters"]["args"].lr == 0.1
