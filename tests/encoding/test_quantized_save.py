"""Quantized tables through save and load: decoded values, metadata, inspect, resharded loads
across ranks, errors, and checkpoints of format version 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import unickpt
from tests.distributed import run_ranks
from tests.integrity._helpers import metadata_path, read_metadata, repin
from unickpt.checkpointer import step_name
from unickpt.cli.main import main
from unickpt.encoding.rowwise import dequantize_rows, quantize_rows
from unickpt.engine.tensor_reader import CheckpointReader
from unickpt.format.codec import decode_metadata, encode_metadata
from unickpt.layouts.boxes import Box
from unickpt.layouts.leaves import ShardedTensor
from unickpt.tools import export_safetensors, export_torch
from unickpt.tools.diff import diff_checkpoints
from unickpt.tools.inspection import inspect_checkpoint
from unickpt.tools.verify import verify_checkpoint


class Recommender(torch.nn.Module):
    def __init__(self, rows: int = 1000, dim: int = 24, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.emb = torch.nn.Embedding(rows, dim, dtype=dtype)
        self.head = torch.nn.Linear(dim, 1)


def _decoded(table: torch.Tensor, bits: int) -> torch.Tensor:
    return dequantize_rows(quantize_rows(table, bits), bits, table.shape[1], table.dtype)


@pytest.mark.parametrize(("bits", "dtype"), [(8, torch.float32), (4, torch.bfloat16)])
def test_a_quantized_table_loads_decoded(tmp_path: Path, bits: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Recommender(dtype=dtype)
    report = unickpt.save(tmp_path / "q", {"model": model}, quantize={"model.emb.weight": bits})
    full = unickpt.save(tmp_path / "full", {"model": model})
    fresh = Recommender(dtype=dtype)
    unickpt.load(tmp_path / "q", {"model": fresh})
    table = model.emb.weight.detach()
    assert torch.equal(fresh.emb.weight.detach(), _decoded(table, bits))
    assert torch.equal(fresh.head.weight, model.head.weight)
    error = report.encoding_errors["model.emb.weight"]
    diff = (fresh.emb.weight.detach().double() - table.double()).abs()
    assert error.max_abs == float(diff.max())
    assert error.rms_relative == pytest.approx(
        float(diff.square().sum().sqrt() / table.double().square().sum().sqrt())
    )
    stored = 1000 * (8 + (24 if bits == 8 else 12))
    others = full.bytes_written - table.numel() * table.itemsize
    assert abs(report.bytes_written - stored - others) < 3 * 64  # chunks start 64-byte aligned
    assert full.encoding_errors == {}
    with CheckpointReader(tmp_path / "q") as reader:  # tools read decoded values
        rows = reader.read_tensor("model.emb.weight", box=Box((10, 4), (5, 7)))
        assert torch.equal(rows, _decoded(table, bits)[10:15, 4:11])
    # Column blocks of the decoded table, also past the stored width (8 + 12 bytes at 4 bits):
    # each needs its rows whole from the stored table.
    for first in (0, 8, 16, 20):
        block = ShardedTensor(torch.zeros(1000, 4, dtype=dtype), (1000, 24), (0, first))
        with pytest.warns(UserWarning, match=r"'model': 2 tensors \(\d+ B\) not loaded"):
            unickpt.load(tmp_path / "q", {"model.emb.weight": block}, strict=False)
        assert torch.equal(block.local, _decoded(table, bits)[:, first : first + 4]), first


def test_metadata_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = Recommender(rows=50, dim=6)
    unickpt.save(tmp_path, {"model": model}, quantize={"model.emb.weight": 4})
    doc = read_metadata(tmp_path)
    assert doc["version"] == 2
    entry = doc["tensors"]["model.emb.weight"]
    assert (entry["dtype"], entry["shape"]) == ("uint8", [50, 8 + 3])
    encoding = entry["encoding"]
    assert {k: encoding[k] for k in ("name", "bits", "dtype", "shape", "scale_dtype")} == {
        "name": "rowwise-affine",
        "bits": 4,
        "dtype": "float32",
        "shape": [50, 6],
        "scale_dtype": "float32",
    }
    assert set(encoding["error"]) == {"max_abs", "rms", "rms_relative"}
    assert "encoding" not in doc["tensors"]["model.head.weight"]
    raw = metadata_path(tmp_path).read_bytes()
    meta = decode_metadata(raw, "m")
    assert encode_metadata(meta) == raw  # the encoding round-trips
    e = meta.tensors["model.emb.weight"].encoding
    assert e is not None and e.error is not None and e.error.max_abs == encoding["error"]["max_abs"]

    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "quantized tables (loads decode them):" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("model.emb.weight  "))
    assert "float32" in line and "[50, 6]" in line and "550 B" in line
    quantized = out.split("quantized tables")[1]
    assert "model.emb.weight  rowwise-affine 4-bit" in quantized
    assert f"{encoding['error']['max_abs']:.4g}" in quantized
    assert f"{encoding['error']['rms_relative']:.3%}" in quantized
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    tensors = {t["key"]: t for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert tensors["model.emb.weight"]["encoding"] == "rowwise-affine 4-bit"
    assert tensors["model.emb.weight"]["max_abs_error"] == encoding["error"]["max_abs"]
    assert tensors["model.head.weight"]["encoding"] is None


def test_conversions_write_decoded_values(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = Recommender(rows=300, dim=20)
    unickpt.save(tmp_path / "q", {"model": model}, quantize={"model.emb.weight": 4})
    export_torch(tmp_path / "q", tmp_path / "q.pt", block_bytes=1000)  # blocks of rows
    export_safetensors(tmp_path / "q", tmp_path / "st", only="model", block_bytes=1000)
    expected = _decoded(model.emb.weight.detach(), 4)
    assert torch.equal(torch.load(tmp_path / "q.pt")["model"]["emb.weight"], expected)
    loaded = safetensors.torch.load_file(next((tmp_path / "st").glob("*.safetensors")))
    assert torch.equal(loaded["emb.weight"], expected)


def test_loads_match_decoded_shapes_verify_and_diff(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = Recommender(rows=40, dim=6)
    unickpt.save(tmp_path / "q", {"model": model}, quantize={"model.emb.weight": 8})
    unickpt.save(tmp_path / "full", {"model": model})
    shape = "'model.emb.weight' has global shape \\[40, 6\\] in the checkpoint but \\[40, 7\\]"
    with pytest.raises(unickpt.CheckpointMismatchError, match=shape):
        unickpt.load(tmp_path / "q", {"model": Recommender(rows=40, dim=7)})
    dtype = "'model.emb.weight' is float32 in the checkpoint but bfloat16 in the state"
    with pytest.raises(unickpt.CheckpointMismatchError, match=dtype):
        unickpt.load(tmp_path / "q", {"model": Recommender(rows=40, dim=6, dtype=torch.bfloat16)})
    assert verify_checkpoint(tmp_path / "q").ok  # the stored codes against their checksums
    report = diff_checkpoints(tmp_path / "full", tmp_path / "q")  # decoded values compared
    (changed,) = report.tensors
    decoded = _decoded(model.emb.weight.detach(), 8)
    assert (changed.key, changed.kind, changed.shape_b) == ("model.emb.weight", "values", (40, 6))
    assert changed.max_abs == float((decoded - model.emb.weight.detach()).abs().max())


def test_a_version_1_checkpoint_still_loads(tmp_path: Path) -> None:
    model = Recommender(rows=20, dim=4)
    unickpt.save(tmp_path, {"model": model})
    doc = read_metadata(tmp_path)
    doc["version"] = 1
    metadata_path(tmp_path).write_bytes(json.dumps(doc).encode())
    for index in tmp_path.glob("index-*.json"):
        idoc = json.loads(index.read_bytes())
        idoc["version"] = 1
        index.write_bytes(json.dumps(idoc).encode())
    repin(tmp_path, {"version": 1})
    fresh = Recommender(rows=20, dim=4)
    unickpt.load(tmp_path, {"model": fresh})
    assert torch.equal(fresh.emb.weight, model.emb.weight)
    assert inspect_checkpoint(tmp_path).format_version == 1


def test_checkpointer_option_and_bad_requests(tmp_path: Path) -> None:
    model = Recommender(rows=30, dim=5)
    with unickpt.Checkpointer(tmp_path / "run", quantize={"model.emb.weight": 8}) as ckpt:
        ckpt.save(1, {"model": model}).wait()
        fresh = Recommender(rows=30, dim=5)
        assert ckpt.load_latest({"model": fresh}) == 1
    assert torch.equal(fresh.emb.weight.detach(), _decoded(model.emb.weight.detach(), 8))
    with pytest.raises(unickpt.CheckpointError, match="quantize asks 3 bits for 'x'; expected 8"):
        unickpt.save(tmp_path / "a", {"model": model}, quantize={"x": 3})
    message = (
        "quantize names 'model.emb', which is not a 2-D floating tensor of the state; the "
        "state's are: model.emb.weight, model.head.weight. Name a table by its key."
    )
    with pytest.raises(unickpt.CheckpointError, match=message):
        unickpt.save(tmp_path / "b", {"model": model}, quantize={"model.emb": 8})
    with torch.no_grad():
        model.emb.weight[3, 1] = float("nan")
    with pytest.raises(unickpt.CheckpointError, match="holds non-finite values in rows 0 to 30"):
        unickpt.save(tmp_path / "c", {"model": model}, quantize={"model.emb.weight": 8})
    fp8 = {"t": torch.randn(10, 4).to(torch.float8_e4m3fn)}
    with pytest.raises(unickpt.CheckpointError, match=r"'t', a table of torch.float8_e4m3fn"):
        unickpt.save(tmp_path / "d", fp8, quantize={"t": 4})
    assert not (tmp_path / "d").exists()


def _table(rows: int = 100, dim: int = 10) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(7))


def _save_sharded(rank: int, world: int, root: str) -> Any:
    table = _table()
    rows = [(0, 37), (37, 100)][rank]
    state = {
        "emb": ShardedTensor(table[rows[0] : rows[1]].clone(), (100, 10), (rows[0], 0)),
        "small": _table(6, 3),  # replicated: written by one rank, its error counted once
    }
    report = unickpt.save(root + "/rows", state, quantize={"emb": 8, "small": 4})
    cols = ShardedTensor(table[:, 5 * rank : 5 * rank + 5].clone(), (100, 10), (0, 5 * rank))
    try:
        unickpt.save(root + "/cols", {"emb": cols}, quantize={"emb": 8})
        split = ""
    except unickpt.CheckpointError as e:
        split = str(e)
    changed = _incremental_quantized(rank, root, table, rows)
    return report.encoding_errors, split, changed


def _changed_table() -> torch.Tensor:
    table = _table()
    table[[5, 6, 60]] += 1.0
    return table


def _incremental_quantized(rank: int, root: str, table: torch.Tensor, rows: tuple[int, int]) -> int:
    """Two saves of a row-sharded table, 8-bit and changed rows only; bytes of the second."""
    local = table[rows[0] : rows[1]].clone()
    state = {"emb": ShardedTensor(local, (100, 10), (rows[0], 0))}
    with unickpt.Checkpointer(
        root + "/run", incremental=True, row_deltas=["emb"], quantize={"emb": 8}, mode="sync"
    ) as ckpt:
        ckpt.save(0, state)
        local.copy_(_changed_table()[rows[0] : rows[1]])
        report = ckpt.save(1, state).wait()
    assert report is not None
    return report.bytes_written


def _load_resharded(rank: int, world: int, root: str) -> Any:
    bounds = [(0, 50), (50, 80), (80, 100)][rank]
    emb = ShardedTensor(torch.zeros(bounds[1] - bounds[0], 10), (100, 10), (bounds[0], 0))
    cols = ShardedTensor(torch.zeros(100, 4), (100, 10), (0, 3 * rank))
    state: dict[str, Any] = {"emb": emb, "small": torch.zeros(6, 3)}
    unickpt.load(root + "/rows", state)
    unickpt.load(root + "/rows", {"emb": cols}, strict=False)  # columns of every row
    expected = _decoded(_table(), 8)
    ok = torch.equal(emb.local, expected[bounds[0] : bounds[1]])
    ok = ok and torch.equal(state["small"], _decoded(_table(6, 3), 4))
    ok = ok and torch.equal(cols.local, expected[:, 3 * rank : 3 * rank + 4])
    # the incremental checkpoint: changed rows in step 1, the others referring to step 0
    unickpt.load(root + "/run/" + step_name(1), {"emb": emb})
    return ok and torch.equal(emb.local, _decoded(_changed_table(), 8)[bounds[0] : bounds[1]])


def test_row_sharded_tables_load_into_another_split(tmp_path: Path) -> None:
    saved = run_ranks(2, _save_sharded, str(tmp_path))
    assert saved[0][0] == saved[1][0]
    errors = saved[0][0]
    whole = _decoded(_table(), 8)
    assert errors["emb"].max_abs == float((whole.double() - _table().double()).abs().max())
    small = (_decoded(_table(6, 3), 4).double() - _table(6, 3).double()).abs()
    assert errors["small"].max_abs == float(small.max())
    assert errors["small"].rms == pytest.approx(float(small.square().mean().sqrt()))
    # the second save wrote the changed rows alone, quantized: rank 0 rows 5-6, rank 1 row 60,
    # 8 + 10 bytes each
    assert [changed for _, _, changed in saved] == [2 * 18, 18]
    for _, split, _ in saved:
        assert "'emb' is held in pieces that split its rows (columns" in split
        assert "Shard the table by rows, or leave it out of quantize." in split
    assert run_ranks(3, _load_resharded, str(tmp_path)) == [True, True, True]


def test_a_row_whose_range_float32_cannot_hold(tmp_path: Path) -> None:
    """Finite values whose row range overflows float32 (where a row's minimum and scale are
    kept) are refused by key and row; a range just inside it round trips finite."""
    table = torch.zeros(4, 3)
    table[1, 0], table[1, 2] = -3e38, 3e38
    with pytest.raises(unickpt.CheckpointError) as info:
        unickpt.save(tmp_path / "q", {"emb": table}, quantize={"emb": 8})
    message = str(info.value)
    assert "'emb' row 1 holds values from -3e+38 to 3e+38, a range wider than float32" in message
    assert "Scale the table down before saving, or leave 'emb' out of quantize." in message
    assert not (tmp_path / "q" / "COMMIT").exists()

    table[1, 0] = -3e37  # a range of 3.3e38
    report = unickpt.save(tmp_path / "q", {"emb": table}, quantize={"emb": 8})
    out = {"emb": torch.empty(4, 3)}
    unickpt.load(tmp_path / "q", out)
    assert torch.equal(out["emb"], _decoded(table, 8)) and bool(out["emb"].isfinite().all())
    error = report.encoding_errors["emb"]
    scale = (3e38 + 3e37) / 255
    assert error.max_abs == float((out["emb"].double() - table.double()).abs().max()) <= scale / 2


def _forge_encoding(path: Path, shape: list[int], stored: list[int] | None = None) -> None:
    doc = read_metadata(path)
    meta = doc["tensors"]["model.emb.weight"]
    meta["encoding"]["shape"] = shape
    if stored is not None:
        meta["shape"] = stored
    metadata_path(path).write_bytes(json.dumps(doc).encode())
    repin(path)


@pytest.mark.parametrize(
    ("shape", "stored", "says"),
    [
        (
            [1 << 31, 1 << 31],
            None,
            "'model.emb.weight' is stored as uint8 [30, 13] with encoding rowwise-affine of 8 "
            "bits of [2147483648, 2147483648]",
        ),
        (
            [1 << 31, 1 << 31],
            [1 << 31, (1 << 31) + 8],
            "bytes, more than the 72057594037927936 bytes unickpt stores in one tensor",
        ),
        ([30, -5], None, "the shape of the encoding of 'model.emb.weight' is [30, -5]"),
    ],
    ids=[
        "decoded shape not the stored one",
        "both shapes past a tensor's bytes",
        "negative",
    ],
)
def test_forged_encoding_shape_allocates_nothing(
    tmp_path: Path, shape: list[int], stored: list[int] | None, says: str
) -> None:
    """A decoded shape comes from the metadata: it must be the shape the stored rows encode,
    and the stored rows must fit in the data files, before a reader sizes a buffer by it."""
    model = Recommender(rows=30, dim=5)
    unickpt.save(tmp_path / "q", {"model": model}, quantize={"model.emb.weight": 8})
    _forge_encoding(tmp_path / "q", shape, stored)
    with (
        pytest.raises(unickpt.CheckpointCorruptError) as info,
        CheckpointReader(tmp_path / "q") as r,
    ):
        r.read_tensor("model.emb.weight")
    assert says in str(info.value)
    damaged = "metadata is (damaged|not well formed)"
    with pytest.raises(unickpt.CheckpointCorruptError, match=damaged):
        export_torch(tmp_path / "q", tmp_path / "q.pt")
    with pytest.raises(unickpt.CheckpointCorruptError, match=damaged):
        unickpt.load(tmp_path / "q", {"model": Recommender(rows=30, dim=5)})
