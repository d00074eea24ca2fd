"""inspect_checkpoint on single-process and 2-rank checkpoints."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.cli.main import main
from unickpt.errors import CheckpointMismatchError
from unickpt.tools import inspect_checkpoint
from unickpt.tools.inspection import ObjectInfo, group_objects, select_entries

from .helpers import save_sample


def test_single_process_summary(tmp_path: Path) -> None:
    before = time.time()
    save_sample(tmp_path / "c")
    s = inspect_checkpoint(tmp_path / "c")
    assert s.world_size == 1
    assert s.producer["torch"] == torch.__version__
    assert "unickpt" in s.producer
    assert before - 1 <= s.created_unix_s <= time.time() + 1
    tensors = {t.key: t for t in s.tensors}
    big = tensors["buffers.big"]
    assert (big.dtype, big.shape, big.layout, big.shards) == (
        "float32",
        (257, 129),
        "replicated",
        1,
    )
    assert big.nbytes == 257 * 129 * 4
    assert tensors["buffers.half"].dtype == "bfloat16"
    assert tensors["buffers.scalar"].shape == ()
    assert tensors["model.0.weight"].shape == (16, 6)
    assert any(k.startswith("optimizer.state.") for k in tensors)
    objects = {o.key: o for o in s.objects}
    assert (objects["step"].type, objects["step"].summary) == ("int", "12")
    assert objects["train.name"].summary == "'run-a'"
    assert objects["train.betas"].type == "tuple"
    assert s.tensor_bytes == sum(t.nbytes for t in s.tensors)
    # Data files hold the chunks plus alignment padding (64 bytes at most each).
    assert 0 <= s.data_bytes - s.tensor_bytes < 64 * len(s.tensors)


def test_json_document_is_complete(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    doc = json.loads(json.dumps(inspect_checkpoint(tmp_path / "c").to_dict()))
    assert doc["world_size"] == 1
    assert doc["totals"]["tensors"] == len(doc["tensors"])
    assert doc["totals"]["tensor_bytes"] == sum(t["nbytes"] for t in doc["tensors"])
    assert {"key", "dtype", "shape", "layout", "shards", "nbytes"} <= set(doc["tensors"][0])
    assert doc["created"].startswith(str(time.gmtime().tm_year))
    assert {o["key"] for o in doc["objects"]} >= {"step", "train.name"}


def test_two_rank_checkpoint(two_rank_checkpoint: Path) -> None:
    s = inspect_checkpoint(two_rank_checkpoint)
    assert s.world_size == 2
    assert len(s.files) == 2
    tensors = {t.key: t for t in s.tensors}
    assert (tensors["model.w"].layout, tensors["model.w"].shards) == ("sharded", 2)
    assert tensors["model.w"].shape == (8, 6)
    assert tensors["model.b"].shards == 1
    objects = {o.key: o for o in s.objects}
    assert objects["data_position"].per_rank
    assert objects["data_position"].summary == "100"


def test_two_rank_checkpoint_from_the_command_line(
    two_rank_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(two_rank_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "world size 2" in out and "sharded" in out and "(per rank)" in out
    assert main(["inspect", str(two_rank_checkpoint), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world_size"] == 2 and doc["totals"]["files"] == 2
    w = next(t for t in doc["tensors"] if t["key"] == "model.w")
    assert (w["shape"], w["shards"], w["nbytes"]) == ([8, 6], 2, 192)


def _titan_like(path: Path, layers: int = 4) -> None:
    """A torchtitan-like step: per-parameter optimizer state and param-group values, the
    same hyperparameters repeated for every parameter."""
    names = [f"layers.{i}.{w}" for i in range(layers) for w in ("wq", "wk")]
    group = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    unickpt.save(
        path,
        {
            "model": {n: torch.ones(2) for n in names},
            "optimizer": {
                "state": {n: {"exp_avg": torch.zeros(2)} for n in names},
                "param_groups": {n: dict(group) for n in names},
            },
            "train_state": {"step": 7},
        },
    )


def test_repeated_values_are_grouped(tmp_path: Path) -> None:
    _titan_like(tmp_path / "c")
    s = inspect_checkpoint(tmp_path / "c")
    assert len(s.objects) == 8 * 4 + 1
    groups = {g.key: (g.summary, g.count) for g in group_objects(s.objects)}
    assert groups == {
        "optimizer.param_groups.layers.*.betas": ("(0.9, 0.95)", 8),
        "optimizer.param_groups.layers.*.eps": ("1e-08", 8),
        "optimizer.param_groups.layers.*.lr": ("0.0003", 8),
        "optimizer.param_groups.layers.*.weight_decay": ("0.1", 8),
        "train_state.step": ("7", 1),
    }


def test_a_differing_value_is_not_grouped_with_the_others(tmp_path: Path) -> None:
    objects = [
        ObjectInfo("opt.groups.a.lr", "float", "0.1"),
        ObjectInfo("opt.groups.b.lr", "float", "0.1"),
        ObjectInfo("opt.groups.c.lr", "float", "0.2"),
    ]
    groups = [(g.key, g.summary, g.count) for g in group_objects(objects)]
    assert groups == [("opt.groups.*.lr", "0.1", 2), ("opt.groups.c.lr", "0.2", 1)]


def test_keys_and_top_level_filters(tmp_path: Path) -> None:
    _titan_like(tmp_path / "c", layers=2)
    s = inspect_checkpoint(tmp_path / "c")
    only_model = select_entries(s, tops=["model"])
    assert [t.key for t in only_model.tensors] == [
        "model.layers.0.wk",
        "model.layers.0.wq",
        "model.layers.1.wk",
        "model.layers.1.wq",
    ]
    assert only_model.objects == ()
    picked = select_entries(s, ["*.lr", "*.1.wq.exp_avg"], ["optimizer", "train_state"])
    assert [t.key for t in picked.tensors] == ["optimizer.state.layers.1.wq.exp_avg"]
    assert [o.key for o in picked.objects] == [
        "optimizer.param_groups.layers.0.wk.lr",
        "optimizer.param_groups.layers.0.wq.lr",
        "optimizer.param_groups.layers.1.wk.lr",
        "optimizer.param_groups.layers.1.wq.lr",
    ]
    with pytest.raises(CheckpointMismatchError, match="--only modle: no such top-level key"):
        select_entries(s, tops=["modle"])
