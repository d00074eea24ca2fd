"""Hugging Face safetensors models loaded online into any layout, and saved from any layout."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import unickpt
from unickpt.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError

from ..distributed import run_ranks
from .jobs import load_tp, save_rows

transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2(seed: int) -> torch.nn.Module:
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=64)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, key: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, key
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), key


def test_sharded_model_loads_into_one_rank_with_key_mapping(tmp_path: Path) -> None:
    model = tiny_llama(0)
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    fresh = tiny_llama(1)
    report = unickpt.load(tmp_path / "hf", {"model": fresh}, keys=lambda k: "model." + k)
    for k, v in model.state_dict().items():
        assert_bitwise(fresh.state_dict()[k], v, k)
    needed = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert report.bytes_read == needed
    assert report.unverified_files and all(
        f.endswith(".safetensors") for f in report.unverified_files
    )


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    with torch.no_grad():
        return model.eval()(ids).logits


def test_tied_head_loads_with_the_embedding_it_shares(tmp_path: Path) -> None:
    """GPT-2's head shares the embedding's memory and save_pretrained stores it once: the
    head is loaded with the embedding, strict, with no warning under strict=False."""
    model = tiny_gpt2(4)
    model.save_pretrained(tmp_path / "hf")
    for strict in (True, False):
        fresh = tiny_gpt2(5)
        assert fresh.lm_head.weight is fresh.transformer.wte.weight
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            report = unickpt.load(
                tmp_path / "hf", {"model": fresh}, keys=lambda k: "model." + k, strict=strict
            )
        assert report.skipped_keys == () and report.unread_keys == ()
        assert_bitwise(logits_of(fresh), logits_of(model), "logits")
    # any checkpoint: a unickpt one that holds the embedding only
    emb = torch.randn(6, 4)
    unickpt.save(tmp_path / "u", {"m": {"emb": emb}})
    shared = torch.zeros(6, 4)
    state = {"m": {"emb": shared, "head": shared}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unickpt.load(tmp_path / "u", state, strict=False)
        unickpt.load(tmp_path / "u", state)
    assert_bitwise(state["m"]["head"], emb, "head")
    # a view inside a loaded tensor (rows of it, a transpose) is loaded with it
    state = {"m": {"emb": shared, "rows": shared[2:4], "t": shared.t()}}
    shared.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = unickpt.load(tmp_path / "u", state)
    assert report.skipped_keys == ()
    assert_bitwise(state["m"]["rows"], emb[2:4].clone(), "rows")
    with pytest.raises(CheckpointMismatchError, match=r"lacks: 'm\.own'"):
        unickpt.load(tmp_path / "u", {"m": {"emb": shared, "own": torch.zeros(2)}})


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama], ids=["gpt2-tied", "llama"])
def test_saved_names_are_those_from_pretrained_reads(tmp_path: Path, make) -> None:
    """keys= renames the state's keys in a save: from_pretrained reads the folder with every
    weight found (logits bitwise equal), and a load takes the inverse map."""
    model = make(6)
    out = tmp_path / "out"
    unickpt.save(
        out, {"model": model}, format="safetensors", keys=lambda k: k.removeprefix("model.")
    )
    model.config.save_pretrained(out)
    loaded, info = type(model).from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert_bitwise(logits_of(loaded), logits_of(model), "logits")
    fresh = make(7)
    unickpt.load(out, {"model": fresh}, keys=lambda k: "model." + k)
    assert_bitwise(logits_of(fresh), logits_of(model), "logits")
    with pytest.raises(CheckpointError, match="the same saved key 'w'"):
        unickpt.save(tmp_path / "x", {"model": model}, format="safetensors", keys=lambda k: "w")


def test_single_file_loads_by_its_path_and_by_its_folder(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(5, 7),
        "b": torch.arange(6, dtype=torch.int32),
        "s": torch.tensor(3.0),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    for path in (tmp_path, tmp_path / "model.safetensors"):
        dest = {k: torch.zeros_like(v) for k, v in tensors.items()}
        unickpt.load(path, dest)
        for k, v in tensors.items():
            assert_bitwise(dest[k], v, k)


def test_strict_and_dtype_rules_are_those_of_a_unickpt_load(tmp_path: Path) -> None:
    save_file({"m.a": torch.randn(4, 4), "m.b": torch.randn(3)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"keys the state lacks: 'm\.b'"):
        unickpt.load(tmp_path, {"m": {"a": torch.zeros(4, 4)}})
    half = {"a": torch.zeros(4, 4, dtype=torch.float16), "b": torch.zeros(3)}
    with pytest.raises(CheckpointMismatchError, match=r"'m\.a' is float32 in the checkpoint"):
        unickpt.load(tmp_path, {"m": half})
    with pytest.warns(UserWarning, match="strict=False"):
        report = unickpt.load(tmp_path, {"m": {"a": torch.zeros(4, 4)}}, strict=False)
    assert report.unread_keys == ("m.b",)


def test_header_pointing_past_the_end_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.randn(64, 64), "b": torch.randn(10)}, tmp_path / "model.safetensors")
    path = tmp_path / "model.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    dest = {"a": torch.zeros(64, 64), "b": torch.zeros(10)}
    with pytest.raises(
        CheckpointCorruptError, match=r"but the file has \d+ bytes; the file is truncated"
    ):
        unickpt.load(tmp_path, dest)


def test_header_length_past_the_end_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointCorruptError, match="gives a header of 1000000 bytes"):
        unickpt.load(tmp_path, {"a": torch.zeros(1)})


def test_keys_mapping_works_for_unickpt_checkpoints(tmp_path: Path) -> None:
    saved = {"old": {"w": torch.randn(3, 4), "n": 5}}
    unickpt.save(tmp_path / "c", saved)
    dest = {"new": {"w": torch.zeros(3, 4), "n": 0}}
    unickpt.load(tmp_path / "c", dest, keys={"old.w": "new.w", "old.n": "new.n"})
    assert_bitwise(dest["new"]["w"], saved["old"]["w"], "w")
    assert dest["new"]["n"] == 5
    with pytest.raises(CheckpointMismatchError, match="keys= maps both"):
        unickpt.load(tmp_path / "c", dest, keys=lambda k: "new.w")


def test_tp_load_on_two_ranks_reads_only_what_each_rank_holds(tmp_path: Path) -> None:
    model = tiny_llama(2)
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    single = str(tmp_path / "one" / "model.safetensors")
    for folder in (tmp_path / "hf", tmp_path / "one"):
        results = run_ranks(2, load_tp, str(folder), single)
        for bytes_read, held, equal in results:
            assert equal
            assert bytes_read == held


def test_save_from_two_ranks_reads_back_with_safe_open_and_transformers(tmp_path: Path) -> None:
    model = tiny_gpt2(3).eval()
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    torch.save(state, tmp_path / "state.pt")
    out = tmp_path / "out"
    run_ranks(2, save_rows, str(tmp_path / "state.pt"), str(out), "30KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once
    read: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(out / name, "pt") as f:
            read.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    assert set(read) == set(state) - {"lm_head.weight"}
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in read.values()
    )
    for k, v in read.items():
        assert_bitwise(v, state[k], k)
    model.config.save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_single_shard_save_is_model_safetensors(tmp_path: Path) -> None:
    state = {"a": torch.randn(4, 3), "b": torch.arange(5)}
    unickpt.save(tmp_path / "o", state, format="safetensors")
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["model.safetensors"]
    with safe_open(tmp_path / "o" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, v in state.items():
            assert_bitwise(f.get_tensor(k), v, k)
    with pytest.raises(CheckpointError, match="already holds a safetensors model"):
        unickpt.save(tmp_path / "o", state, format="safetensors")


def test_save_refuses_non_tensor_values(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"stores only tensors.*'step'"):
        unickpt.save(tmp_path / "o", {"w": torch.zeros(2), "step": 3}, format="safetensors")
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())
