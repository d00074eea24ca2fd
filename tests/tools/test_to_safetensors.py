"""unickpt -> safetensors, read back with safetensors.torch.load_file, bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.errors import CheckpointExistsError, CheckpointMismatchError
from unickpt.tools import export_safetensors

from .helpers import assert_bitwise, make_model, make_tied_model, reader_tensors, save_sample

st = pytest.importorskip("safetensors.torch")


def test_single_file_bitwise(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    report = export_safetensors(tmp_path / "c", tmp_path / "out", block_bytes=1000)
    loaded = st.load_file(tmp_path / "out" / "model.safetensors")
    expected = reader_tensors(tmp_path / "c")
    assert set(loaded) == set(expected)
    for key, t in expected.items():
        assert_bitwise(loaded[key], t, key)
    assert report.tensors == len(expected)
    assert {x.split(":")[0] for x in report.left_out} >= {"step", "train.name"}


def test_sharded_with_index(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    expected = reader_tensors(tmp_path / "c")
    total = sum(t.numel() * t.element_size() for t in expected.values())
    export_safetensors(tmp_path / "c", tmp_path / "out", max_shard_bytes=2000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 3
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (tmp_path / "out" / "model.safetensors").exists()
    loaded: dict[str, torch.Tensor] = {}
    for name in files:
        part = st.load_file(tmp_path / "out" / name)
        assert all(index["weight_map"][k] == name for k in part)
        loaded.update(part)
    assert set(loaded) == set(expected)
    for key, t in expected.items():
        assert_bitwise(loaded[key], t, key)


def test_only_model_loads_into_module(tmp_path: Path) -> None:
    state = save_sample(tmp_path / "c")
    export_safetensors(tmp_path / "c", tmp_path / "out", only="model")
    loaded = st.load_file(tmp_path / "out" / "model.safetensors")
    fresh = make_model(seed=99)
    fresh.load_state_dict(loaded)
    for key, t in state["model"].state_dict().items():
        assert_bitwise(fresh.state_dict()[key], t, key)


def test_file_destination_and_overwrite(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    dst = tmp_path / "weights.safetensors"
    export_safetensors(tmp_path / "c", dst, only="buffers")
    assert set(st.load_file(dst)) == {"big", "half", "ids", "mask", "scalar", "empty"}
    with pytest.raises(CheckpointExistsError):
        export_safetensors(tmp_path / "c", dst)
    export_safetensors(tmp_path / "c", dst, only="model", overwrite=True)
    assert set(st.load_file(dst)) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_overwrite_replaces_sharded_with_single(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    export_safetensors(tmp_path / "c", tmp_path / "out", max_shard_bytes=50_000)
    export_safetensors(tmp_path / "c", tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_unknown_subtree_is_explained(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    with pytest.raises(CheckpointMismatchError, match="top-level names: buffers, model"):
        export_safetensors(tmp_path / "c", tmp_path / "out", only="modle")


def _tied_gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_tied_weights_are_written_once(tmp_path: Path) -> None:
    model = make_tied_model()
    unickpt.save(tmp_path / "c", {"model": model})
    report = export_safetensors(tmp_path / "c", tmp_path / "out", only="model")
    loaded = st.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(loaded) == ["head.bias", "wte.weight"]
    assert_bitwise(loaded["wte.weight"], model["wte"].weight.detach(), "wte.weight")
    assert report.tensor_bytes == (5 * 3 + 5) * 4


def test_tied_gpt2_exports_as_save_pretrained_does(tmp_path: Path) -> None:
    model = _tied_gpt2()
    unickpt.save(tmp_path / "c", {"model": model})
    export_safetensors(tmp_path / "c", tmp_path / "hf", only="model")
    model.config.save_pretrained(tmp_path / "hf")
    model.save_pretrained(tmp_path / "reference")
    ours = st.load_file(tmp_path / "hf" / "model.safetensors")
    theirs = st.load_file(tmp_path / "reference" / "model.safetensors")
    assert sorted(ours) == sorted(theirs) and "lm_head.weight" not in ours
    again = type(model).from_pretrained(tmp_path / "hf")
    assert again.lm_head.weight is again.transformer.wte.weight
    for key, t in model.state_dict().items():
        assert_bitwise(again.state_dict()[key], t, key)


def test_tied_weights_are_reported_and_untie_writes_every_key(tmp_path: Path) -> None:
    model = make_tied_model()
    unickpt.save(tmp_path / "c", {"model": model})
    report = export_safetensors(tmp_path / "c", tmp_path / "out", only="model")
    assert report.tied == (("head.weight", "wte.weight"),)
    report = export_safetensors(tmp_path / "c", tmp_path / "all", only="model", untie=True)
    assert report.tied == ()
    loaded = st.load_file(tmp_path / "all" / "model.safetensors")
    assert sorted(loaded) == ["head.bias", "head.weight", "wte.weight"]
    assert_bitwise(loaded["head.weight"], model["wte"].weight.detach(), "head.weight")
    assert_bitwise(loaded["wte.weight"], model["wte"].weight.detach(), "wte.weight")
    assert report.tensor_bytes == (2 * 5 * 3 + 5) * 4
