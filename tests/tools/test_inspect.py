"""inspect_checkpoint on single-process and 2-rank checkpoints."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from unickpt.cli.main import main
from unickpt.tools import inspect_checkpoint

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
