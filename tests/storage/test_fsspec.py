"""Checkpoints through fsspec: memory:// in one process; fsspec's local files across processes,
with resharding; the Checkpointer, verify, inspect and the command line on URLs."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from tests.distributed import run_ranks
from unickpt.config import get_config
from unickpt.storage import open_storage, register_backend
from unickpt.storage.fsspec import FsspecStorage
from unickpt.tools import inspect_checkpoint, verify_checkpoint

from .scenarios import (
    async_and_refused_saves,
    checkpointer_and_command_line,
    load_layouts,
    save_layouts,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KiB = 1024
# Small parts and segments, so a save has many parts that arrive out of order.
CONFIG = get_config(
    segment_bytes=4 * KiB, window_bytes=32 * KiB, read_piece_bytes=32 * KiB, small_chunk_bytes=KiB
)


def _memory_url(name: str) -> str:
    return f"memory://unickpt-test-{uuid.uuid4().hex[:8]}/{name}"


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(40, 30)
    with torch.no_grad():
        model.weight.copy_(torch.randn(30, 40, generator=g))
    return {
        "model": model,
        "big": torch.randn(300, 129, generator=g),  # 151 KiB: cut into several parts
        "small": {f"s{i}": torch.full((i + 1,), float(seed + i)) for i in range(30)},
        "step": seed,
    }


def _blank() -> dict[str, Any]:
    state = _state(0)
    for t in [state["model"].weight, state["model"].bias, state["big"], *state["small"].values()]:
        with torch.no_grad():
            t.fill_(-1)
    state["step"] = -1
    return state


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["model"].weight, b["model"].weight)
    assert torch.equal(a["big"], b["big"])
    assert all(torch.equal(a["small"][k], b["small"][k]) for k in a["small"])
    assert a["step"] == b["step"]


def test_save_load_verify_inspect_through_memory() -> None:
    url = _memory_url("ckpt")
    state = _state(5)
    unickpt.save(url, state, config=CONFIG)
    dest = _blank()
    unickpt.load(url, dest, config=CONFIG)
    _assert_same(dest, state)
    # a resharding read: only a block of "big", read as byte ranges
    part = unickpt.ShardedTensor(torch.zeros(100, 50), (300, 129), (150, 60))
    unickpt.load(url, {"big": part}, strict=False, config=CONFIG)
    assert torch.equal(part.local, state["big"][150:250, 60:110])
    assert verify_checkpoint(url).ok
    summary = inspect_checkpoint(url)
    assert summary.path == open_storage(url).location and summary.world_size == 1
    # damage is found through the backend as on files
    storage = open_storage(url)
    assert isinstance(storage, FsspecStorage)
    data = next(n for n in storage.list_names() if n.startswith("data-"))
    raw = bytearray(storage.read_bytes(data) or b"")
    raw[1000] ^= 0x40
    storage.fs.pipe_file(f"{storage.path}/{data}", bytes(raw))
    report = verify_checkpoint(url)
    assert not report.ok and "checksum mismatch" in report.damage[0].message
    with pytest.raises(unickpt.CheckpointCorruptError, match="checksum mismatch"):
        unickpt.load(url, _blank(), config=CONFIG)


def test_an_async_save_and_a_failed_save_through_memory() -> None:
    bad = _memory_url("bad")
    async_and_refused_saves(_memory_url("async"), bad, _state, _blank, _assert_same, CONFIG)
    assert not [n for n in open_storage(bad).list_names() if n.startswith("data-")]


def test_checkpointer_through_memory(capsys: pytest.CaptureFixture[str]) -> None:
    checkpointer_and_command_line(_memory_url("run"), _state, _blank, _assert_same, CONFIG, capsys)


def _register_fsspec_files() -> None:
    """``fsfile:///path`` is fsspec's local file system: fsspec code paths on real files,
    across processes (memory:// lives in one process)."""
    register_backend("fsfile", lambda url: FsspecStorage("file://" + url[len("fsfile://") :]))


def _save_layouts(rank: int, world: int, root: str) -> None:
    _register_fsspec_files()
    save_layouts(rank, world, root, CONFIG)


def _load_layouts(rank: int, world: int, root: str) -> list[str]:
    _register_fsspec_files()
    return load_layouts(rank, world, root, CONFIG)[0]


def test_reshard_through_fsspec_files(tmp_path: Path) -> None:
    root = f"fsfile://{tmp_path}"
    run_ranks(2, _save_layouts, root)
    assert [w for wrong in run_ranks(3, _load_layouts, root) for w in wrong] == []
    _register_fsspec_files()
    # the bytes are the same checkpoint the local backend reads
    assert verify_checkpoint(tmp_path / "layouts").ok
    assert verify_checkpoint(f"{root}/layouts").ok
