"""Lossless compression (``compress=True``): round trips, resharded loads, damage, ratios,
incremental saves, the memory tier, and the format version of uncompressed checkpoints."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

import unickpt
from tests.api.layouts_zoo import mesh
from tests.distributed import run_ranks, start_ranks
from tests.storage.s3_server import moto_server, new_bucket
from tests.tiers import workers
from unickpt.config import get_config
from unickpt.engine.commit import read_checkpoint
from unickpt.engine.compress import decode_unit, encode_unit, group_bytes, ungroup_bytes
from unickpt.errors import CheckpointCorruptError, CheckpointError
from unickpt.format.metadata import FORMAT_VERSION, PLAIN_FORMAT_VERSION, Metadata
from unickpt.root.names import step_name
from unickpt.storage import LocalStorage
from unickpt.tools.verify import verify_checkpoint

SEG = 4096


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "f32": torch.randn(300, 70, generator=g) * 1e-3,
        "bf16": (torch.randn(257, 33, generator=g) * 0.02).to(torch.bfloat16),
        "f16": (torch.randn(5000, generator=g) * 0.1).to(torch.float16),
        "i64": torch.randint(-50, 50, (4000,), generator=g, dtype=torch.int64),
        "bool": torch.rand(3000, generator=g) > 0.7,
        "empty": torch.empty(0, 5),
        "zeros": torch.zeros(64, 64),
        "random bytes": torch.randint(0, 256, (20000,), generator=g, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
    }


def _meta(path: Path | str) -> Metadata:
    return read_checkpoint(LocalStorage(str(path)))[1]


def _stored_ratio(meta: Metadata, key: str) -> float:
    chunks = meta.tensors[key].chunks
    return sum(c.stored_nbytes for c in chunks) / sum(c.nbytes for c in chunks)


@pytest.mark.parametrize("segment", [SEG, 1 << 20])
def test_round_trips_bit_for_bit(tmp_path: Path, segment: int) -> None:
    state = _every_dtype()
    config = get_config(segment_bytes=segment)
    unickpt.save(tmp_path / "c", state, compress=True, config=config)
    dest = {k: torch.full_like(v, 1) if v.dtype != torch.bool else ~v for k, v in state.items()}
    unickpt.load(tmp_path / "c", dest, config=config)
    for k, v in state.items():
        assert dest[k].dtype == v.dtype and torch.equal(dest[k].view(-1), v.view(-1)), k
    meta = _meta(tmp_path / "c")
    assert meta.version == FORMAT_VERSION
    packed = {k for k, t in meta.tensors.items() if any(c.compression for c in t.chunks)}
    assert {"f32", "bf16", "f16", "i64", "bool", "zeros"} <= packed
    assert "random bytes" not in packed and "empty" not in packed  # nothing gained: raw


def test_byte_grouping_and_frames() -> None:
    raw = torch.arange(12, dtype=torch.int32).view(torch.uint8).numpy()
    planes = group_bytes(raw, 4)
    assert planes[:12].tolist() == list(range(12)) and not planes[12:].any()
    assert ungroup_bytes(planes, 4).tobytes() == raw.tobytes()
    frame = encode_unit(raw, 4)
    assert decode_unit(frame, len(raw), 4).tobytes() == raw.tobytes()
    with pytest.raises(ValueError, match="decodes to 48 bytes, expected 40"):
        decode_unit(frame, 40, 4)


def test_ratio_targets_on_trained_weight_like_data(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    weights = (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(20):
        x = torch.randn(32, 256, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    moments = {
        f"{i}.{k}": s[k]
        for i, s in enumerate(opt.state.values())
        for k in ("exp_avg", "exp_avg_sq")
    }
    state = {"w": weights, **moments}
    report = unickpt.save(tmp_path / "c", state, compress=True)
    meta = _meta(tmp_path / "c")
    assert _stored_ratio(meta, "w") <= 0.80
    stored = sum(c.stored_nbytes for k in moments for c in meta.tensors[k].chunks)
    raw = sum(c.nbytes for k in moments for c in meta.tensors[k].chunks)
    assert stored / raw <= 0.92
    plain = unickpt.save(tmp_path / "plain", state)
    assert report.bytes_written < plain.bytes_written
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    unickpt.load(tmp_path / "c", dest)
    assert all(torch.equal(dest[k], v) for k, v in state.items())


def test_a_flipped_byte_is_found_before_decoding(tmp_path: Path) -> None:
    w = (torch.randn(512, 512) * 0.02).to(torch.bfloat16)  # 512 KiB: 128 segments
    config = get_config(segment_bytes=SEG)
    unickpt.save(tmp_path / "c", {"model.w": w}, compress=True, config=config)
    chunk = _meta(tmp_path / "c").tensors["model.w"].chunks[0]
    assert chunk.compression is not None and chunk.stored_nbytes < chunk.nbytes
    assert verify_checkpoint(tmp_path / "c").ok
    (data,) = (tmp_path / "c").glob("data-*.bin")
    raw = bytearray(data.read_bytes())
    at = chunk.byte_offset + chunk.stored_nbytes // 2
    raw[at] ^= 0x10
    data.write_bytes(bytes(raw))
    (damage,) = verify_checkpoint(tmp_path / "c").damage  # the one segment, stored bytes
    assert damage.key == "model.w" and damage.start is not None and damage.stop is not None
    assert damage.start <= at < damage.stop and damage.stop - damage.start < SEG
    with pytest.raises(CheckpointCorruptError, match=r"checksum mismatch .*'model\.w'"):
        unickpt.load(tmp_path / "c", {"model.w": torch.zeros_like(w)}, config=config)
    # without verification the damage reaches the decoder: a damaged frame is named, or it
    # decodes to different values; never silently to the saved ones
    dest = {"model.w": torch.zeros_like(w)}
    try:
        unickpt.load(tmp_path / "c", dest, config=get_config(segment_bytes=SEG, verify=False))
    except CheckpointCorruptError as e:
        assert "'model.w'" in str(e)
    else:
        assert not torch.equal(dest["model.w"], w)


def test_uncompressed_checkpoints_keep_the_previous_version(tmp_path: Path) -> None:
    state = {"w": torch.randn(100, 100)}
    unickpt.save(tmp_path / "plain", state)
    unickpt.save(tmp_path / "packed", state, compress=True)
    for name, version in (("plain", PLAIN_FORMAT_VERSION), ("packed", FORMAT_VERSION)):
        folder = tmp_path / name
        docs = [json.loads(p.read_text()) for p in folder.glob("*.json")]
        assert {d["version"] for d in docs} == {version}, name
    assert PLAIN_FORMAT_VERSION == 2 and FORMAT_VERSION == 3
    plain = (tmp_path / "plain").glob("index-*.json")
    assert all(len(row) == 6 for p in plain for row in json.loads(p.read_text())["chunks"])


def test_compress_without_the_codec_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed
    with pytest.raises(CheckpointError, match=r"needs the zstandard package.*pip install"):
        unickpt.save(tmp_path / "c", {"w": torch.ones(3)}, compress=True)
    with pytest.raises(CheckpointError, match="zstandard"):
        unickpt.Checkpointer(tmp_path / "run", compress=True)
    assert not (tmp_path / "c").exists()


def test_incremental_saves_with_compression(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {
        "frozen": (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16),
        "adapter": torch.randn(64, 64, generator=g) * 1e-2,
        "noise": torch.randint(0, 256, (5000,), generator=g, dtype=torch.uint8),
    }
    with unickpt.Checkpointer(
        tmp_path, incremental=True, mode="sync", compress=True, full_every=4
    ) as ckpt:
        ckpt.save(1, state).wait()
        state["adapter"] += 1
        ckpt.save(2, state).wait()
        state["adapter"] += 1
        ckpt.save(3, state).wait()
        for step in (2, 3):
            meta = _meta(tmp_path / step_name(step))
            assert meta.version == FORMAT_VERSION
            assert any(c.compression for c in meta.tensors["adapter"].chunks)
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.load_latest(dest) == 3
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    # unchanged chunks are referred to, not written again, compressed ones included
    meta = _meta(tmp_path / step_name(3))
    (frozen,) = meta.tensors["frozen"].chunks
    assert meta.files[frozen.file].startswith(f"../{step_name(1)}/")
    assert frozen.compression is not None
    assert meta.files[meta.tensors["noise"].chunks[0].file].startswith("../")
    assert not meta.files[meta.tensors["adapter"].chunks[0].file].startswith("../")


def _tier_state(step: int) -> dict[str, Any]:
    return {"w": (torch.randn(300, 200) * 0.02 + step).to(torch.bfloat16), "step": step}


def test_a_restarted_job_refers_to_compressed_chunks(tmp_path: Path) -> None:
    """The first save of a restarted incremental Checkpointer refers to the compressed chunks
    of the newest checkpoint that did not change (their index has only the checksums of the
    stored bytes: the chunk is compressed again and compared), and so does the save after."""
    g = torch.Generator().manual_seed(2)
    state = {
        "frozen": (torch.randn(512, 512, generator=g) * 0.02).to(torch.bfloat16),
        "adapter": torch.randn(64, 64, generator=g) * 1e-2,
    }
    options: dict[str, Any] = {"incremental": True, "mode": "sync", "compress": True}
    with unickpt.Checkpointer(tmp_path, full_every=10, **options) as ckpt:
        first = ckpt.save(1, state).wait()
    written = []
    with unickpt.Checkpointer(tmp_path, full_every=10, **options) as ckpt:  # the job restarted
        for step in (2, 3):
            state["adapter"] += 1
            report = ckpt.save(step, state).wait()
            assert report is not None
            written.append(report.bytes_written)
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.load_latest(dest) == 3
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    assert first is not None
    for step, nbytes in zip((2, 3), written):
        meta = _meta(tmp_path / step_name(step))
        (frozen,) = meta.tensors["frozen"].chunks
        assert meta.files[frozen.file].startswith(f"../{step_name(1)}/"), step
        (adapter,) = meta.tensors["adapter"].chunks
        assert nbytes == _data_size(tmp_path / step_name(step)) == adapter.stored_nbytes, step
        assert nbytes < first.bytes_written / 10, (step, nbytes, first.bytes_written)


def _data_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("data-*.bin"))


def test_the_memory_tier_holds_and_persists_compressed_checkpoints(tmp_path: Path) -> None:
    tier = unickpt.MemoryTier(persist_every=2, replicas=1, dir=tmp_path / "shm")
    root = tmp_path / "root"
    saved = {}
    with unickpt.Checkpointer(root, memory=tier, compress=True) as ckpt:
        for step in range(1, 4):
            saved[step] = _tier_state(step)
            ckpt.save(step, saved[step]).wait()
        dest = {"w": torch.zeros(300, 200, dtype=torch.bfloat16), "step": 0}
        assert ckpt.load_latest(dest) == 3
        assert ckpt.last_restore is not None and ckpt.last_restore.source == "memory"
        assert torch.equal(dest["w"], saved[3]["w"]) and dest["step"] == 3
    persisted = _meta(root / step_name(2))
    assert persisted.version == FORMAT_VERSION and _stored_ratio(persisted, "w") < 0.9
    dest = {"w": torch.zeros(300, 200, dtype=torch.bfloat16), "step": 0}
    unickpt.load(root / step_name(2), dest)
    assert torch.equal(dest["w"], saved[2]["w"])


def _sharded_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a": torch.randn(256, 96, generator=g) * 1e-3,  # 48 KiB chunks: 12 segments
        "b": (torch.randn(33, 40, generator=g) * 0.02).to(torch.bfloat16),  # rows 17 / 16
        "c": torch.randint(-1000, 1000, (10, 12), generator=g, dtype=torch.int64),
        "d": torch.randn(8, 24, 40, generator=g).to(torch.float16),  # 3-D
        "e": torch.rand(64, 32, generator=g) > 0.5,
    }


def _sharded(dim: int, world: int, fill: bool) -> dict[str, Any]:
    return {
        k: distribute_tensor(t if fill else torch.zeros_like(t), mesh((world,)), [Shard(dim)])
        for k, t in _sharded_tensors().items()
    }


def _save_and_reshard(rank: int, world: int, root: str) -> dict[str, bool]:
    config = get_config(segment_bytes=SEG)
    path = f"{root}/c"
    unickpt.save(path, _sharded(0, world, fill=True), compress=True, config=config)
    small = get_config(segment_bytes=SEG, window_bytes=16 * SEG, read_piece_bytes=16 * SEG)
    out = {}
    for name, url, cfg in (
        ("default", path, config),
        ("small pieces", path, small),
        ("alone", path, get_config(share_reads=False)),
        ("fsspec", f"file://{path}", small),
        ("unverified", path, get_config(verify=False)),
    ):
        for dim in (0, 1):
            dest = _sharded(dim, world, fill=False)
            unickpt.load(url, dest, config=cfg)
            want = _sharded(dim, world, fill=True)
            out[f"{name} dim {dim}"] = all(
                torch.equal(dest[k].to_local(), want[k].to_local()) for k in want
            )
    dist.barrier()
    return out


def test_two_rank_compressed_save_resharded_and_loaded_at_one_rank(tmp_path: Path) -> None:
    results = run_ranks(2, _save_and_reshard, str(tmp_path))
    for r in results:
        assert all(r.values()), [k for k, ok in r.items() if not ok]
    meta = _meta(tmp_path / "c")
    assert meta.world_size == 2 and len(meta.files) == 2
    assert all(c.compression for c in meta.tensors["a"].chunks)
    want = _sharded_tensors()
    dest = {k: torch.zeros_like(v) for k, v in want.items()}
    unickpt.load(tmp_path / "c", dest)  # one process, whole tensors
    assert all(torch.equal(dest[k], v) for k, v in want.items())


def test_tables_compared_row_by_row_are_stored_plainly(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    state = {
        "emb": (torch.randn(4096, 64, generator=g) * 0.02).to(torch.bfloat16),
        "w": (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16),
    }
    options: dict[str, Any] = {"incremental": True, "row_deltas": ["emb"], "compress": True}
    with unickpt.Checkpointer(tmp_path, mode="sync", **options) as ckpt:
        ckpt.save(1, state).wait()
        state["emb"][100:110] += 1
        ckpt.save(2, state).wait()
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.load_latest(dest) == 2
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    meta = _meta(tmp_path / step_name(2))
    assert not any(c.compression for c in meta.tensors["emb"].chunks)  # later saves refer to rows
    assert len(meta.tensors["emb"].chunks) > 1 and meta.references
    assert all(c.compression for c in meta.tensors["w"].chunks)


def _save_steps_compressed(
    rank: int, world: int, root: str, dirs: dict[int, str], nodes: dict[int, str]
) -> None:
    """Steps 1 to 3 through a memory tier with two replicas, compressed; step 2 persisted."""
    workers.node_env(rank, nodes)
    tier = unickpt.MemoryTier(persist_every=2, replicas=2, dir=dirs[rank])
    ckpt = unickpt.Checkpointer(root, keep_last=3, memory=tier, compress=True)
    rows = world * workers.ROWS
    for step in (1, 2, 3):
        ckpt.save(step, workers.state(step, rank, world, rows))
    ckpt.wait()
    workers.persisted(ckpt)
    dist.barrier()


@pytest.mark.parametrize("cols", [False, True])
def test_peers_restore_compressed_checkpoints(tmp_path: Path, cols: bool) -> None:
    """A node lost with its memory: its rank fetches the compressed files from the peer's
    replica (same layout, or resharded by columns), values checked bitwise by the workers."""
    root = str(tmp_path / "store")
    dirs = {0: str(tmp_path / "node-a"), 1: str(tmp_path / "node-b")}
    nodes = {0: "a", 1: "b"}
    procs, _ = start_ranks(2, _save_steps_compressed, root, dirs, nodes)
    for p in procs:
        p.kill()
    for p in procs:
        p.join(30)
    persisted = _meta(Path(root) / step_name(2))
    assert persisted.version == FORMAT_VERSION
    assert all(c.compression for c in persisted.tensors["w"].chunks)
    shutil.rmtree(dirs[1])
    rows = 2 * workers.ROWS
    results = run_ranks(2, workers.restart_in_pieces, root, dirs, nodes, rows, 4096, cols)
    assert [r[:2] for r in results] == [(3, "memory"), (3, "peer")]


@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[str]:
    pytest.importorskip("moto.server")
    with moto_server() as url:
        yield new_bucket(url)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_slice_reads_only_the_segments_that_hold_it(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """A load of a few rows of a compressed tensor (a resharded load at one rank) reads the
    stored segments that hold them, from files or from an object store."""
    w = (torch.randn(2000, 300) * 0.02).to(torch.bfloat16)  # 1.2 MB: 293 segments of 4 KiB
    url = (
        str(tmp_path / "c")
        if where == "local"
        else f"s3://{request.getfixturevalue('s3_bucket')}/c"
    )
    config = get_config(segment_bytes=SEG, window_bytes=64 * SEG, read_piece_bytes=64 * SEG)
    unickpt.save(url, {"w": w, "b": torch.zeros(7)}, compress=True, config=config)
    dest = {
        "w": unickpt.ShardedTensor(
            torch.zeros(10, 300, dtype=torch.bfloat16), (2000, 300), (1500, 0)
        )
    }
    report = unickpt.load(url, dest, config=config, strict=False)
    assert torch.equal(dest["w"].local, w[1500:1510])
    assert report.bytes_read <= 3 * SEG  # 6,000 bytes of rows: the (raw) 3 segments decoded
    whole = {"w": torch.zeros_like(w), "b": torch.ones(7)}
    unickpt.load(url, whole, config=config)
    assert torch.equal(whole["w"], w) and not whole["b"].any()


@pytest.mark.parametrize("background", [False, True])
def test_async_saves_compress_in_the_background(tmp_path: Path, background: bool) -> None:
    state = _every_dtype()
    fut = unickpt.async_save(tmp_path / "c", state, compress=True, zero_stall=background)
    fut.wait()
    assert _meta(tmp_path / "c").version == FORMAT_VERSION
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    unickpt.load(tmp_path / "c", dest)
    assert all(torch.equal(dest[k].view(-1), v.view(-1)) for k, v in state.items())
