"""Checkpoints through fsspec: memory:// in one process; fsspec's local files across processes,
with resharding; the Checkpointer, verify, inspect and the command line on URLs."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from tests.api.layouts_zoo import LAYOUTS, global_tensors, local_of, zeroed
from tests.distributed import run_ranks
from unickpt.cli.main import main
from unickpt.config import get_config
from unickpt.storage import open_storage, register_backend
from unickpt.storage.fsspec import FsspecStorage
from unickpt.tools import inspect_checkpoint, verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KiB = 1024
# Small parts and segments, so a save has many parts that arrive out of order.
CONFIG = get_config(
    segment_bytes=4 * KiB, window_bytes=32 * KiB, read_piece_bytes=32 * KiB, small_chunk_bytes=KiB
)
SAVE_LAYOUTS = ("dt_row", "megatron", "flat", "replicated")


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
    url = _memory_url("async")
    state = _state(2)
    unickpt.async_save(url, state, config=CONFIG).wait()
    with pytest.raises(unickpt.CheckpointExistsError):
        unickpt.save(url, _state(3), config=CONFIG)
    dest = _blank()
    unickpt.load(url, dest)
    _assert_same(dest, state)
    bad = _memory_url("bad")
    with pytest.raises(unickpt.UnsafeObjectError):
        unickpt.save(bad, {"w": torch.ones(3), "o": object()})
    assert not [n for n in open_storage(bad).list_names() if n.startswith("data-")]


def test_checkpointer_through_memory(capsys: pytest.CaptureFixture[str]) -> None:
    root = _memory_url("run")
    with unickpt.Checkpointer(root, keep_last=2, config=CONFIG) as ckpt:
        for step in range(4):
            ckpt.save(step, _state(step))
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
        assert ckpt.path(3) == f"{open_storage(root).location}/step-000000003"
    # an interrupted save's folder: ignored by listings, removed by the next save
    storage = open_storage(root)
    storage.child("step-000000009").write_atomic("data-x-00000.bin", b"partial")
    reader = unickpt.Checkpointer(root)
    assert reader.steps() == [2, 3]
    dest = _blank()
    assert reader.load_latest(dest) == 3
    _assert_same(dest, _state(3))
    with unickpt.Checkpointer(root, keep_last=2, async_save=False, config=CONFIG) as ckpt:
        ckpt.save(4, _state(4))
    assert storage.list_names() == ["step-000000003", "step-000000004"]
    # the command line takes the newest committed step of a root, or --step N
    assert main(["inspect", root]) == 0
    assert "step-000000004" in capsys.readouterr().out
    assert main(["verify", root, "--step", "3"]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {storage.location}/step-000000003")
    assert main(["diff", root, root, "--step", "4"]) == 0
    capsys.readouterr()


def _register_fsspec_files() -> None:
    """``fsfile:///path`` is fsspec's local file system: fsspec code paths on real files,
    across processes (memory:// lives in one process)."""
    register_backend("fsfile", lambda url: FsspecStorage("file://" + url[len("fsfile://") :]))


def _save_layouts(rank: int, world: int, root: str) -> None:
    _register_fsspec_files()
    tensors = global_tensors()
    state = {
        lay: {n: LAYOUTS[lay](t, rank, world) for n, t in tensors.items()} for lay in SAVE_LAYOUTS
    }
    unickpt.save(f"{root}/layouts", state, config=CONFIG)
    with unickpt.Checkpointer(f"{root}/run", keep_last=1, config=CONFIG) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": LAYOUTS["dt_row"](tensors["a"] * step, rank, world)})


def _load_layouts(rank: int, world: int, root: str) -> list[str]:
    _register_fsspec_files()
    tensors = global_tensors()
    wrong = []
    for dest_layout in ("dt_col", "flat", "replicated"):
        make = LAYOUTS[dest_layout]
        state = {
            lay: {n: zeroed(make(t, rank, world)) for n, t in tensors.items()}
            for lay in SAVE_LAYOUTS
        }
        unickpt.load(f"{root}/layouts", state, config=CONFIG)
        for lay in SAVE_LAYOUTS:
            for n, t in tensors.items():
                if not torch.equal(local_of(state[lay][n]), local_of(make(t, rank, world))):
                    wrong.append(f"{lay} -> {dest_layout}@{world}: {n}")
    ckpt = unickpt.Checkpointer(f"{root}/run")
    dest = {"w": zeroed(LAYOUTS["flat"](tensors["a"], rank, world))}
    if ckpt.load_latest(dest) != 2 or ckpt.steps() != [2]:
        wrong.append(f"steps {ckpt.steps()}")
    if not torch.equal(
        local_of(dest["w"]), local_of(LAYOUTS["flat"](tensors["a"] * 2, rank, world))
    ):
        wrong.append("checkpointer step 2")
    return wrong


def test_reshard_through_fsspec_files(tmp_path: Path) -> None:
    root = f"fsfile://{tmp_path}"
    run_ranks(2, _save_layouts, root)
    assert [w for wrong in run_ranks(3, _load_layouts, root) for w in wrong] == []
    _register_fsspec_files()
    # the bytes are the same checkpoint the local backend reads
    assert verify_checkpoint(tmp_path / "layouts").ok
    assert verify_checkpoint(f"{root}/layouts").ok
