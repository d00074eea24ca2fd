"""safetensors files and sharded folders -> unickpt -> unickpt.load, bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.tools import diff_checkpoints, export_safetensors, import_safetensors

from .helpers import assert_bitwise, make_model

st = pytest.importorskip("safetensors.torch")


def test_safetensors_file_and_sharded_folder(tmp_path: Path) -> None:
    tensors = {
        "model.layers.0.weight": torch.randn(8, 4),
        "model.layers.0.bias": torch.randn(8).to(torch.float16),
        "lm_head.weight": torch.randn(3, 8),
        "mask": torch.tensor([True, False]),
    }
    st.save_file(tensors, tmp_path / "one.safetensors")
    import_safetensors(tmp_path / "one.safetensors", tmp_path / "c1")
    folder = tmp_path / "hf"
    folder.mkdir()
    names = sorted(tensors)
    st.save_file({k: tensors[k] for k in names[:2]}, folder / "model-00001-of-00002.safetensors")
    st.save_file({k: tensors[k] for k in names[2:]}, folder / "model-00002-of-00002.safetensors")
    weight_map = {k: f"model-0000{1 + i // 2}-of-00002.safetensors" for i, k in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    report = import_safetensors(folder, tmp_path / "c2")
    assert report.tensors == 4
    for path in (tmp_path / "c1", tmp_path / "c2"):
        dest = {k: torch.zeros_like(v) for k, v in tensors.items()}
        unickpt.load(path, dest)
        for k, v in tensors.items():
            assert_bitwise(dest[k], v, k)


def test_exported_safetensors_import_back(tmp_path: Path) -> None:
    unickpt.save(tmp_path / "a", {"model": make_model(1)})
    export_safetensors(tmp_path / "a", tmp_path / "hf", max_shard_bytes=200)
    import_safetensors(tmp_path / "hf", tmp_path / "b")
    assert diff_checkpoints(tmp_path / "a", tmp_path / "b").identical
