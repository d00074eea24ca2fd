"""docs/format.md is enough to read every checkpoint unickpt writes.

The spec's sample reader (its ```python blocks whose first line is ``# spec-sample``) is run
without unickpt, with json, numpy, xxhash and zstandard alone (and the standard library's
base64, zlib and pathlib), on every kind of checkpoint, plain and compressed: tensors of every
dtype, values, tied weights and an optimizer in one process; row shards, column blocks, flat
ranges, a DTensor, replicas, per-rank values and a quantized table from two ranks; incremental
chains with references and row deltas, one continued by a restarted job; 8- and 4-bit
quantized tables of each floating dtype. What it reads must equal, bit for bit, what
``unickpt.load`` gives; a version newer than it knows is refused.
"""

from __future__ import annotations

import builtins
import json
import math
import re
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import unickpt
from tests.api.layouts_zoo import dt_col
from tests.distributed import run_ranks
from unickpt.config import Config
from unickpt.format.dtypes import known_dtype_names
from unickpt.root.names import open_checkpoint

SPEC = Path(__file__).resolve().parents[2] / "docs" / "format.md"
ALLOWED_IMPORTS = {"base64", "json", "numpy", "pathlib", "xxhash", "zlib", "zstandard"}
QUANTIZED_DTYPES = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
SEGMENT = 4096
SMALL_SEGMENTS = Config(segment_bytes=SEGMENT)

Reader = dict[str, Any]


def spec_sample() -> str:
    """The sample reader of docs/format.md: its ``# spec-sample`` blocks, in order."""
    return "\n".join(re.findall(r"```python\n(# spec-sample\n.*?)```", SPEC.read_text(), re.S))


def _guarded_import(
    name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
) -> Any:
    if name.split(".")[0] not in ALLOWED_IMPORTS:
        raise ImportError(
            f"the sample reader of docs/format.md imports {name}; it may use only "
            f"{', '.join(sorted(ALLOWED_IMPORTS))}"
        )
    return builtins.__import__(name, globals, locals, fromlist, level)


@pytest.fixture(scope="module")
def spec() -> Reader:
    source = spec_sample()
    assert source, f"{SPEC} has no ```python block whose first line is '# spec-sample'"
    namespace: Reader = {
        "__builtins__": {**vars(builtins), "__import__": _guarded_import},
        "__name__": "spec_sample",
    }
    exec(compile(source, str(SPEC), "exec"), namespace)
    return namespace


# -- comparing what the spec's reader reads with what unickpt loads ------------------------


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _sentinel(dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` whose bytes are all 0xA5 (what a load must replace)."""
    size = getattr(torch, dtype).itemsize
    raw = torch.full((math.prod(shape) * size,), 0xA5, dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).reshape(shape)


def _same(found: Any, loaded: Any, key: str) -> None:
    """``found`` (the spec reader's) is ``loaded`` (unickpt's): tensors bit for bit, values
    of the same types."""
    if isinstance(loaded, torch.Tensor):
        assert isinstance(found, np.ndarray), (key, type(found))
        assert found.shape == tuple(loaded.shape), (key, found.shape, loaded.shape)
        assert bytes(np.ascontiguousarray(found)) == _raw(loaded), key
    elif isinstance(loaded, (list, tuple)):
        assert type(found) is type(loaded) and len(found) == len(loaded), (key, found, loaded)
        for i, (a, b) in enumerate(zip(found, loaded)):
            _same(a, b, f"{key}[{i}]")
    elif isinstance(loaded, dict):
        assert isinstance(found, dict) and list(found) == list(loaded), (key, found, loaded)
        for k in loaded:
            _same(found[k], loaded[k], f"{key}.{k}")
    else:
        assert type(found) is type(loaded), (key, found, loaded)
        assert found == loaded or (found != found and loaded != loaded), (key, found, loaded)


def check_checkpoint(spec: Reader, folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read every tensor and value of ``folder`` with the spec's reader and with
    ``unickpt.load``; they must be equal. The metadata and the spec reader's chunks."""
    meta, chunks = spec["open_checkpoint"](folder)
    tensors, aliases = meta["tensors"], meta["aliases"]
    state: dict[str, Any] = {}
    for key in [*tensors, *aliases]:
        t = tensors[aliases.get(key, key)]
        values = t.get("encoding", t)
        state[key] = _sentinel(values["dtype"], values["shape"])
    state.update({k: None for k in meta["objects"]})
    state.update({k: unickpt.PerRank(None) for k in meta["per_rank"]})
    resharded = meta["world_size"] > 1 and meta["per_rank"]  # loaded by one process
    with pytest.warns(UserWarning, match="get it back") if resharded else nullcontext():
        unickpt.load(folder, state)
    for key in [*tensors, *aliases]:
        _same(spec["read_tensor"](meta, chunks, key), state[key], key)
    for key, encoded in meta["objects"].items():
        _same(spec["decode_value"](encoded), state[key], key)
    for key, encoded in meta["per_rank"].items():  # this one process is rank 0
        _same(spec["decode_value"](encoded[0]), state[key].value, key)
    _check_chunk_map(spec, folder, meta, chunks)
    return meta, chunks


def _inside(offsets: list[int], lengths: list[int], box: tuple[list[int], list[int]]) -> bool:
    lo, n = box
    return all(a <= o and o + s <= a + m for o, s, a, m in zip(offsets, lengths, lo, n))


def _check_chunk_map(spec: Reader, folder: Path, meta: dict[str, Any], chunks: Any) -> None:
    """The map's boxes tile each tensor, hold its chunks, and name an index listing them."""
    boxes = spec["chunk_map_boxes"](meta)
    assert boxes is not None and boxes.keys() == meta["tensors"].keys()
    listed = []
    for f in meta["files"]:
        index = json.loads((folder / f["index"]).read_text())
        listed.append({c[0] for c in index["chunks"]} | {r[0] for r in index.get("runs", [])})
    for key, found in boxes.items():
        count = np.zeros(meta["tensors"][key]["shape"], dtype=np.int64)
        for offsets, lengths, file in found:
            count[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] += 1
            assert key in listed[file], (key, file)
        assert (count == 1).all(), key
        for offsets, lengths, *_ in chunks[key]:
            assert any(_inside(offsets, lengths, (lo, n)) for lo, n, _ in found), (key, offsets)


def _compressed(chunks: dict[str, Any]) -> tuple[int, int]:
    """How many of the spec reader's chunks are compressed, and how many of their segments
    are stored raw."""
    packed = [c[6] for cs in chunks.values() for c in cs if c[6] is not None]
    raw = sum(1 for p in packed for n in p["stored"] if n == SEGMENT)
    return len(packed), raw


def _random(dtype: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (every bit pattern: NaNs, infinities, subnormals)."""
    size = getattr(torch, dtype).itemsize
    raw = torch.randint(0, 256, (math.prod(shape) * size,), dtype=torch.uint8, generator=gen)
    if dtype == "bool":
        raw %= 2
    return raw.view(getattr(torch, dtype)).reshape(shape)


# -- one process: every dtype, shapes, values, tied weights, an optimizer -------------------


def test_the_spec_names_every_dtype_unickpt_stores(spec: Reader) -> None:
    assert set(spec["DTYPES"]) == set(known_dtype_names()) - QUANTIZED_DTYPES


@pytest.mark.parametrize("compress", [False, True])
def test_one_process_every_dtype_values_ties_and_an_optimizer(
    spec: Reader, tmp_path: Path, compress: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    shared = torch.randn(5, 4, generator=gen)
    state = {
        "dtypes": {name: _random(name, (3, 5), gen) for name in sorted(spec["DTYPES"])},
        "shapes": {
            "zero_d": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "empty_3d": torch.empty(2, 0, 3, dtype=torch.int16),
            "segments": torch.randn(3, 2000, generator=gen),  # 24000 bytes: 6 segments
            "compressible": (torch.randn(64, 64, generator=gen) * 0.01).to(torch.bfloat16),
            "mostly_zero": torch.cat([torch.zeros(3000), torch.randn(3000, generator=gen)]),
            "half_noise": torch.cat(  # a segment that compresses, one stored raw
                [torch.zeros(SEGMENT), torch.randint(0, 256, (SEGMENT,), generator=gen)]
            ).to(torch.uint8),
            "transposed": torch.arange(12.0).reshape(3, 4).t(),
        },
        "emb": {"weight": shared},
        "head": {"weight": shared},  # tied: an alias of emb.weight
        "model": model,
        "optim": opt,
        "by_int": {0: torch.arange(3), 1: 7},
        "values": {
            "big": 2**80,
            "float": 1.0,
            "nan": float("nan"),
            "inf": float("-inf"),
            "bytes": b"\x00\xff",
            "tuple": (1, "x", None, True),
            "list": [1.5, {"k": [2, 3.25]}],
            "tensor_in_tuple": (torch.arange(4, dtype=torch.int16), 2),
            "empty_dict": {},
            "empty_list": [],
        },
    }
    unickpt.save(tmp_path / "c", state, config=SMALL_SEGMENTS, compress=compress)
    meta, chunks = check_checkpoint(spec, tmp_path / "c")
    assert meta["version"] == (3 if compress else 2)
    packed, stored_raw = _compressed(chunks)
    assert (packed > 2 and stored_raw > 0) if compress else packed == 0
    assert meta["aliases"] == {"head.weight": "emb.weight"}
    assert meta["tensors"]["optim.state.0.weight.step"]["shape"] == []
    assert meta["objects"]["optim.param_groups"]["$list"][0]["$dict"]["params"] == {
        "$list": ["0.weight", "0.bias", "2.weight", "2.bias"]
    }
    assert chunks["shapes.empty"] == [] and len(chunks["shapes.segments"][0][5]) == 6
    assert meta["objects"]["values.big"] == 2**80 and "by_int.0" in meta["tensors"]


# -- two ranks: shards, blocks, flat ranges, a DTensor, replicas, per-rank values ----------


def _globals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "rows": torch.randn(8, 6, generator=g),
        "blocks": torch.randn(3, 8, 5, generator=g).to(torch.bfloat16),
        "flat": torch.randint(-(2**40), 2**40, (5, 7), generator=g),
        "dt": torch.randn(6, 4, generator=g).to(torch.float16),
        "replicated": torch.randn(4, 3, generator=g).to(torch.float64),
        "table": torch.randn(10, 7, generator=g),
    }


def _save_two_ranks(rank: int, world: int, root: str) -> None:
    full = _globals()
    cut = 13 if rank == 0 else 35 - 13  # a flat range that ends inside a row
    state = {
        "rows": unickpt.ShardedTensor(full["rows"][rank * 4 : rank * 4 + 4], (8, 6), (rank * 4, 0)),
        "blocks": unickpt.ShardedTensor(
            full["blocks"][:, rank * 4 : rank * 4 + 4].clone(), (3, 8, 5), (0, rank * 4, 0)
        ),
        "flat": unickpt.FlatShard(
            full["flat"].reshape(-1)[rank * 13 : rank * 13 + cut].clone(), (5, 7), rank * 13
        ),
        "dt": dt_col(full["dt"], rank, world),
        "replicated": full["replicated"].clone(),
        "table": unickpt.ShardedTensor(
            full["table"][rank * 5 : rank * 5 + 5], (10, 7), (rank * 5, 0)
        ),
        "rng": unickpt.PerRank(torch.arange(3) + rank),
        "step": 7,
    }
    if rank == 1:
        state["only_rank_1"] = torch.arange(5.0)
    unickpt.save(Path(root) / "mixed", state, quantize={"table": 8})
    unickpt.save(Path(root) / "compressed", state, quantize={"table": 8}, compress=True)
    # a save in which rank 0 holds no tensor: it writes no file
    alone: dict[str, Any] = {"pos": unickpt.PerRank(rank), "v": [1, 2]}
    if rank == 0:
        alone["only_0"] = unickpt.PerRank("zero")
    if rank == 1:
        alone["t"] = torch.arange(10.0)
    unickpt.save(Path(root) / "one_file", alone)


def test_two_ranks_every_layout(spec: Reader, tmp_path: Path) -> None:
    run_ranks(2, _save_two_ranks, str(tmp_path))
    meta, chunks = check_checkpoint(spec, tmp_path / "mixed")
    assert meta["world_size"] == 2 and len(meta["files"]) == 2
    assert len(chunks["flat"]) > 2 and meta["tensors"]["table"]["encoding"]["bits"] == 8
    meta, chunks = check_checkpoint(spec, tmp_path / "compressed")
    assert meta["world_size"] == 2 and _compressed(chunks)[0] >= 2
    meta, _ = check_checkpoint(spec, tmp_path / "one_file")
    assert [f["data"][-9:] for f in meta["files"]] == ["00001.bin"]
    assert meta["per_rank"]["pos"] == [0, 1] and meta["chunk_map"] is not None
    assert meta["per_rank"]["only_0"] == ["zero", {"$absent": True}]


# -- an incremental chain: references, row deltas, a quantized table by rows ---------------


@pytest.mark.parametrize("compress", [False, True])
def test_incremental_chain_with_row_deltas(spec: Reader, tmp_path: Path, compress: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    emb = torch.randn(3000, 16, generator=gen)  # 64-byte rows, 47 segments
    q4 = torch.randn(2000, 9, generator=gen)  # stored rows of 13 bytes
    frozen = torch.randn(100, 100, generator=gen)
    changes = [[], [5, 6, 7, 1500], [6, 10, 2000, 2001, 2002, 2999], [1, 2]]
    options: dict[str, Any] = {
        "incremental": True,
        "mode": "sync",
        "row_deltas": ["tables.*"],
        "full_every": 10,
        "config": SMALL_SEGMENTS,
        "quantize": {"tables.q4": 4},
        "compress": compress,
    }
    for steps in (range(3), range(3, 4)):  # then a restarted job's first save
        with unickpt.Checkpointer(tmp_path, **options) as ckpt:
            for step in steps:
                rows = changes[step]
                emb[rows] += 1.0
                q4[[r % 2000 for r in rows]] -= 0.5
                state = {
                    "tables": {"emb": emb, "q4": q4},
                    "frozen": frozen,
                    "lora": torch.randn(4, 4, generator=gen),
                    "step": step,
                }
                ckpt.save(step, state)
    for step in range(4):
        _, chunks = check_checkpoint(spec, tmp_path / f"step-{step:09d}")
        assert (_compressed(chunks)[0] > 0) == compress
    frozen_chunks = chunks["frozen"]
    assert [c[2].parent.name for c in frozen_chunks] == ["step-000000000"] * len(frozen_chunks)
    index = json.loads(next((tmp_path / "step-000000002").glob("index-*.json")).read_text())
    assert [r[0] for r in index["runs"]] == ["tables.emb", "tables.q4"]
    assert {f for r in index["runs"] for f in r[5]} == {0, 1, 2}, "own file and two steps"
    assert [c[6] for c in index["chunks"] if c[0] == "frozen"] == [0]
    (tmp_path / "step-000000009").mkdir()  # an interrupted save: no COMMIT
    newest = spec["newest_step"](tmp_path)
    assert newest == tmp_path / "step-000000003"
    assert open_checkpoint(tmp_path).location.endswith(newest.name)


# -- quantized tables of each floating dtype, 8 and 4 bits ---------------------------------


def test_quantized_tables(spec: Reader, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    tables = {
        "f32_8": torch.randn(50, 12, generator=gen) * 100,
        "f32_4": torch.randn(50, 7, generator=gen),
        "bf16_4": torch.randn(40, 9, generator=gen).to(torch.bfloat16),
        "bf16_8": torch.randn(40, 16, generator=gen).to(torch.bfloat16) * 3,
        "f16_8": torch.randn(30, 5, generator=gen).to(torch.float16),
        "f64_4": torch.randn(30, 6, generator=gen).to(torch.float64),
        "one_column_4": torch.randn(20, 1, generator=gen),
    }
    tables["f32_8"][3] = 2.5  # a constant row: scale 0
    bits = {k: int(k[-1]) for k in tables}
    unickpt.save(tmp_path / "q", {**tables, "plain": torch.arange(3)}, quantize=bits)
    meta, _ = check_checkpoint(spec, tmp_path / "q")
    for key, b in bits.items():
        assert meta["tensors"][key]["encoding"]["bits"] == b


# -- versions: what the reader does not know, it refuses -------------------------------------


@pytest.mark.parametrize("where", ["metadata", "index"])
def test_a_newer_version_is_refused(spec: Reader, tmp_path: Path, where: str) -> None:
    unickpt.save(tmp_path / "c", {"w": torch.arange(4.0)}, compress=True)
    folder = tmp_path / "c"
    commit = json.loads((folder / "COMMIT").read_text())
    meta_path = folder / commit["metadata_file"]
    meta = json.loads(meta_path.read_text())
    if where == "index":
        index_path = folder / meta["files"][0]["index"]
        index = json.loads(index_path.read_text())
        index["version"] = 4
        raw = json.dumps(index).encode()
        index_path.write_bytes(raw)
        meta["files"][0]["index_nbytes"] = len(raw)
        meta["files"][0]["index_checksum"] = spec["checksum"](raw)
    else:
        meta["version"] = 4
    raw = json.dumps(meta).encode()
    meta_path.write_bytes(raw)
    commit["metadata_nbytes"], commit["metadata_checksum"] = len(raw), spec["checksum"](raw)
    (folder / "COMMIT").write_text(json.dumps(commit))
    kind = "unickpt-index" if where == "index" else "unickpt"
    with pytest.raises(ValueError, match=f"version 4; this reader reads {kind} versions 1 to 3"):
        spec["open_checkpoint"](folder)
