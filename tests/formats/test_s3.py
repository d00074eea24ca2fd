"""Hugging Face models and DCP folders on S3 (a real moto server) load online by ranged reads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import unickpt

from ..storage.s3_server import moto_server, new_bucket, raw_client


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    with moto_server() as url:
        yield url


def _upload(endpoint: str, bucket: str, folder: Path, prefix: str) -> None:
    client = raw_client(endpoint)
    for f in folder.iterdir():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())


def test_sharded_safetensors_on_s3_loads_a_block(endpoint: str, tmp_path: Path) -> None:
    tensors = {"a.w": torch.randn(64, 32), "a.b": torch.randn(32), "c": torch.arange(10)}
    save_file({"a.w": tensors["a.w"]}, tmp_path / "model-00001-of-00002.safetensors")
    rest = {k: tensors[k] for k in ("a.b", "c")}
    save_file(rest, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {"a.w": "model-00001-of-00002.safetensors"}
    weight_map.update(dict.fromkeys(rest, "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    bucket = new_bucket(endpoint)
    _upload(endpoint, bucket, tmp_path, "hf")
    rows = torch.zeros(16, 32)
    part = unickpt.ShardedTensor(rows, global_shape=(64, 32), offsets=(16, 0))
    with pytest.warns(UserWarning, match="not loaded"):
        report = unickpt.load(f"s3://{bucket}/hf", {"a": {"w": part}}, strict=False)
    assert torch.equal(rows, tensors["a.w"][16:32])
    assert report.bytes_read == 16 * 32 * 4
