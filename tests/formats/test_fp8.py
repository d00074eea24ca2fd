"""FP8 weights stored in blocks with scales (DeepSeek-V3's layout) load online, dequantized."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import unickpt
from unickpt.errors import CheckpointError, CheckpointMismatchError
from unickpt.foreign.fp8_blocks import BlockScaled, Stored
from unickpt.storage.local import LocalStorage

from ..distributed import run_ranks
from ..storage.s3_server import moto_server, new_bucket, raw_client

FP8_MAX = 448.0  # the largest float8_e4m3fn
SHAPES = {
    "model.layers.0.mlp.down_proj.weight": (300, 200),  # edge blocks in both dimensions
    "model.layers.0.mlp.up_proj.weight": (256, 384),  # whole blocks only
    "model.layers.0.self_attn.q_proj.weight": (40, 72),  # one edge block
}
FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def values(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * (1 + torch.arange(shape[1]) / 16)


def quantize(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 codes and one float32 scale per block (amax / 448), as DeepSeek-V3 stores."""
    grid = (math.ceil(x.shape[0] / block[0]), math.ceil(x.shape[1] / block[1]))
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(grid, dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            scales[i, j] = x[rows, cols].abs().amax() / FP8_MAX
            codes[rows, cols] = (x[rows, cols] / scales[i, j]).to(torch.float8_e4m3fn)
    return codes, scales


def dequantized(
    codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Each code times its block's scale, in float32, then rounded once to ``dtype``."""
    rows, cols = codes.shape
    grid = scales.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)
    return (codes.float() * grid[:, :cols]).to(dtype)


def write_model(folder: Path, block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """A two-shard fp8 model (one weight's scales in the other shard than its codes, a bf16
    norm beside) and its index; the stored tensors by key."""
    stored: dict[str, torch.Tensor] = {"model.norm.weight": torch.randn(200).bfloat16()}
    for n, (key, shape) in enumerate(SHAPES.items()):
        stored[key], stored[key + "_scale_inv"] = quantize(values(shape, n), block)
    first = {k: v for k, v in stored.items() if "down_proj" in k or "q_proj.weight_scale" in k}
    second = {k: v for k, v in stored.items() if k not in first}
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for name, part in zip(FILES, (first, second)):
        save_file(part, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return stored


def expected(
    stored: dict[str, torch.Tensor], dtype: torch.dtype, block: tuple[int, int] = (128, 128)
) -> dict[str, torch.Tensor]:
    out = {"model.norm.weight": stored["model.norm.weight"]}
    for key in SHAPES:
        out[key] = dequantized(stored[key], stored[key + "_scale_inv"], block, dtype)
    return out


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, key: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, key
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), key


def empty_state(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {k: torch.full(s, 7.0, dtype=dtype) for k, s in SHAPES.items()}
    state["model.norm.weight"] = torch.zeros(200, dtype=torch.bfloat16)
    return state


class RecordingStorage(LocalStorage):
    """A local folder that records the byte ranges read from each file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.reads: list[tuple[str, int, int]] = []

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.reads.append((name, offset, out.nbytes))
        super().read_into(name, offset, out)


def byte_ranges(folder: Path, key: str) -> tuple[str, int]:
    """The file holding ``key`` and where its bytes start there."""
    for name in FILES:
        raw = (folder / name).read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + length])
        if key in header:
            return name, 8 + length + header[key]["data_offsets"][0]
    raise KeyError(key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_load_dequantized_into_the_states_dtype(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    stored = write_model(tmp_path / "hf")
    state = empty_state(dtype)
    report = unickpt.load(tmp_path / "hf", state, dequantize=True)
    for k, v in expected(stored, dtype).items():
        assert_bitwise(state[k], v, k)
    assert report.skipped_keys == () and report.unread_keys == ()
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in state.values())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_values_equal_those_of_dcps_quantized_reader(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.quantized_hf_storage import (
        QuantizedHuggingFaceStorageReader,
    )

    write_model(tmp_path / "hf")
    for dtype in (torch.float32, torch.bfloat16):
        ours = empty_state(dtype)
        unickpt.load(tmp_path / "hf", ours, dequantize=True)
        theirs = empty_state(dtype)
        reader = QuantizedHuggingFaceStorageReader(str(tmp_path / "hf"), target_dtype=dtype)
        dcp_load(theirs, storage_reader=reader, no_dist=True)
        for k in SHAPES:
            assert_bitwise(ours[k], theirs[k], k)


def test_without_the_option_a_float_state_is_refused_naming_it(tmp_path: Path) -> None:
    stored = write_model(tmp_path / "hf")
    state = empty_state(torch.bfloat16)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"'model\.layers\.0\.mlp\.down_proj\.weight' is float8_e4m3fn in the checkpoint, "
        r"stored in blocks with the scales '[^']+_scale_inv', but bfloat16 in the state "
        r"\(and 2 more such weights\); pass dequantize=True",
    ):
        unickpt.load(tmp_path / "hf", state)
    assert torch.equal(
        state["model.layers.0.mlp.up_proj.weight"],
        empty_state(torch.bfloat16)["model.layers.0.mlp.up_proj.weight"],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = unickpt.load(tmp_path / "hf", state, strict=False)
    assert any("pass dequantize=True" in str(w.message) for w in caught)
    assert set(report.skipped_keys) == set(SHAPES)
    assert_bitwise(state["model.norm.weight"], stored["model.norm.weight"], "norm")


def test_fp8_state_loads_the_codes_and_scales_as_stored(tmp_path: Path) -> None:
    stored = write_model(tmp_path / "hf")
    state = {k: torch.zeros_like(v) for k, v in stored.items()}
    unickpt.load(tmp_path / "hf", state)
    for k, v in stored.items():
        assert_bitwise(state[k], v, k)


def test_block_size_from_the_config_or_the_option(tmp_path: Path) -> None:
    block = (64, 32)
    stored = write_model(tmp_path / "hf", block)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"'model\.layers\.0\.mlp\.down_proj\.weight_scale_inv' is float32 \[5, 7\]; with "
        r"blocks of 128x128, '[^']+' \(float8_e4m3fn \[300, 200\]\) needs float32 scales "
        r"\[3, 2\]\. Pass the model's block size as dequantize=\(rows, cols\)",
    ):
        unickpt.load(tmp_path / "hf", empty_state(torch.float32), dequantize=True)
    state = empty_state(torch.float32)
    unickpt.load(tmp_path / "hf", state, dequantize=block)
    for k, v in expected(stored, torch.float32, block).items():
        assert_bitwise(state[k], v, k)
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    state = empty_state(torch.bfloat16)
    unickpt.load(tmp_path / "hf", state, dequantize=True)
    for k, v in expected(stored, torch.bfloat16, block).items():
        assert_bitwise(state[k], v, k)


def test_a_row_block_reads_only_its_rows_and_their_scales(tmp_path: Path) -> None:
    stored = write_model(tmp_path / "hf")
    key = "model.layers.0.mlp.down_proj.weight"
    rows = (130, 260)  # block rows 1 and 2 of 0..2
    local = torch.zeros(rows[1] - rows[0], 200, dtype=torch.bfloat16)
    storage = RecordingStorage(tmp_path / "hf")
    state = {key: unickpt.ShardedTensor(local, (300, 200), (rows[0], 0))}
    with pytest.warns(UserWarning, match="not loaded"):
        unickpt.load(storage, state, strict=False, dequantize=True)
    full = expected(stored, torch.bfloat16)[key]
    assert_bitwise(local, full[rows[0] : rows[1]], key)
    codes_file, codes_at = byte_ranges(tmp_path / "hf", key)
    scales_file, scales_at = byte_ranges(tmp_path / "hf", key + "_scale_inv")
    data = [r for r in storage.reads if r[2] > 8 and not r[0].endswith(".json")]
    headers = {(name, 8) for name in FILES}
    data = [r for r in data if (r[0], r[1]) not in headers]
    assert sorted(data) == sorted(
        [
            (codes_file, codes_at + rows[0] * 200, (rows[1] - rows[0]) * 200),
            (scales_file, scales_at + 1 * 2 * 4, 2 * 2 * 4),
        ]
    )


def test_any_byte_range_of_a_weight_is_its_dequantized_bytes(tmp_path: Path) -> None:
    stored = write_model(tmp_path / "hf")
    key = "model.layers.0.mlp.down_proj.weight"
    want = expected(stored, torch.bfloat16)[key].reshape(-1).view(torch.uint8)
    weight = BlockScaled(
        key,
        (300, 200),
        (128, 128),
        torch.float8_e4m3fn,
        Stored(*byte_ranges(tmp_path / "hf", key)),
        Stored(*byte_ranges(tmp_path / "hf", key + "_scale_inv")),
        torch.bfloat16,
    )
    storage = LocalStorage(tmp_path / "hf")
    # whole, one row, across block rows, odd starts and ends (half values), the last byte
    for start, stop in [(0, 120000), (400, 800), (51150, 51251), (25599, 77001), (119999, 120000)]:
        out = bytearray(stop - start)
        weight.fill(storage, start, memoryview(out))
        assert bytes(out) == want[start:stop].numpy().tobytes(), (start, stop)


def load_split(rank: int, world: int, folder: str, dim: int) -> dict[str, torch.Tensor]:
    """Load the model into DTensors split on ``dim`` over ``world`` ranks; the local blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {}
    for key, value in empty_state(torch.bfloat16).items():
        placement = Shard(dim) if value.ndim == 2 else Replicate()
        state[key] = distribute_tensor(value, mesh, [placement])
    unickpt.load(folder, {"model": state}, keys=lambda k: "model." + k, dequantize=True)
    return {k: v.to_local() for k, v in state.items()}


@pytest.mark.parametrize("dim", [0, 1])
def test_two_ranks_load_their_rows_or_columns(tmp_path: Path, dim: int) -> None:
    stored = write_model(tmp_path / "hf")
    full = expected(stored, torch.bfloat16)
    results = run_ranks(2, load_split, str(tmp_path / "hf"), dim)
    for rank, local in enumerate(results):
        for k, v in full.items():
            want = v.tensor_split(2, dim)[rank] if v.ndim == 2 else v
            assert_bitwise(local[k], want.contiguous(), f"rank {rank} {k}")


def test_the_option_is_checked_and_only_for_safetensors(tmp_path: Path) -> None:
    write_model(tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"dequantize is \(0, 128\); expected True"):
        unickpt.load(tmp_path / "hf", empty_state(torch.float32), dequantize=(0, 128))
    unickpt.save(tmp_path / "ckpt", {"w": torch.ones(3)})
    with pytest.raises(
        CheckpointMismatchError, match=r"holds a unickpt checkpoint; dequantize reads the float8"
    ):
        unickpt.load(tmp_path / "ckpt", {"w": torch.zeros(3)}, dequantize=True)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    with moto_server() as url:
        yield url


def test_a_model_on_s3_loads_dequantized_by_ranged_reads(endpoint: str, tmp_path: Path) -> None:
    stored = write_model(tmp_path / "hf")
    bucket = new_bucket(endpoint)
    client = raw_client(endpoint)
    for f in (tmp_path / "hf").iterdir():
        client.put_object(Bucket=bucket, Key=f"hf/{f.name}", Body=f.read_bytes())
    state = empty_state(torch.bfloat16)
    unickpt.load(f"s3://{bucket}/hf", state, dequantize=True)
    for k, v in expected(stored, torch.bfloat16).items():
        assert_bitwise(state[k], v, k)
