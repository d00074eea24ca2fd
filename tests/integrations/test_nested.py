from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from unickpt.errors import CheckpointError, UnsafeObjectError
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


def _one_rank_fails(rank: int, world: int, folder: str) -> list[str]:
    """A save whose object rank 1 cannot store without pickle, then a load from a folder
    rank 1 does not find: each fails on every rank, as the one rank's error."""
    import os

    os.environ["UNICKPT_COLLECTIVE_TIMEOUT_S"] = "20"  # a rank left waiting gives up soon
    obj: dict[str, object] = {"w": torch.full((3,), float(rank)), "epoch": 2}
    if rank == 1:
        obj["args"] = argparse.Namespace(lr=0.1)
    outcomes = []
    for attempt in (
        lambda: save_nested(f"{folder}/c", obj),
        lambda: load_nested(f"{folder}/c" if rank == 0 else f"{folder}/elsewhere"),
    ):
        try:
            attempt()
            outcomes.append("done")
        except CheckpointError as e:
            outcomes.append(str(e))
    return outcomes


def test_a_save_or_load_that_fails_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    save_nested(tmp_path / "c", {"w": torch.zeros(3), "epoch": 1})
    results = run_ranks(2, _one_rank_fails, str(tmp_path), timeout_s=180)
    assert results[0] == results[1]
    saved, loaded = results[0]
    assert saved.startswith(
        "preparing the save failed on 1 of 2 ranks:\n  rank 1: UnsafeObjectError: 'args' "
    ), saved
    assert loaded.startswith(
        "reading what the checkpoint holds failed on 1 of 2 ranks:\n  rank 1: "
        f"CheckpointNotFoundError: no checkpoint at {tmp_path}/elsewhere: "
    ), loaded
