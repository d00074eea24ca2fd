"""The memory tier in one process: placement, the choice of step, bounds, persist, guard."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from tests.tiers.workers import persisted
from unickpt.root import RootIdentity
from unickpt.storage.base import WriteHandle
from unickpt.storage.local import LocalStorage
from unickpt.tiers.memory import Holding, MemoryStore, job_name
from unickpt.tiers.nodes import Nodes
from unickpt.tiers.restore import choose


def test_group_placement() -> None:
    two = Nodes.from_names(0, ["a", "a", "b", "b"])
    assert two.members == ((0, 1), (2, 3)) and two.node_of(3) == 1
    assert two.sends(2) == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert two.sends(1) == []
    three = Nodes.from_names(0, ["a", "b", "c"])  # the odd node joins the last group: a ring
    assert three.sends(2) == [(0, 1), (1, 2), (2, 0)]
    four = Nodes.from_names(0, ["a", "b", "c", "d"])  # two groups: losing a and c loses nothing
    assert four.sends(2) == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert four.sends(3) == [(0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (2, 0), (3, 0), (3, 1)]
    uneven = Nodes.from_names(2, ["a", "a", "a", "b"])
    assert uneven.sends(2) == [(0, 3), (1, 3), (2, 3), (3, 0)] and not uneven.is_leader


def _held(step: int, meta: str | None, required: Sequence[str], present: Sequence[str]) -> Holding:
    return Holding(step, meta, tuple(required), frozenset(present))


def test_choose_newest_complete_across_nodes() -> None:
    files = ("data-a-00000.bin", "data-a-00001.bin")
    newer = ("data-b-00000.bin", "data-b-00001.bin")
    node0 = [_held(4, "m-a", files, files[:1]), _held(5, "m-b", newer, newer[:1])]
    node1 = [_held(4, None, (), files[1:])]  # its commit copy never arrived: files still count
    choice = choose([node0, node1])
    assert choice is not None and choice.step == 4 and choice.commit_nodes == (0,)
    assert choice.holders == {files[0]: (0,), files[1]: (1,)}
    assert choose([node0[1:]]) is None


def test_job_names_and_settings() -> None:
    gpt = RootIdentity("/runs/gpt", "a1")
    assert job_name(gpt) == job_name(RootIdentity("/runs/gpt", "a1"))
    assert job_name(gpt) != job_name(RootIdentity("/runs/gpt", "b2"))  # deleted and made anew
    assert job_name(gpt) != job_name(RootIdentity("/other/gpt", "a1"))
    assert job_name(RootIdentity("s3://bucket/run-7", "a1")).startswith("run-7-")
    with pytest.raises(unickpt.CheckpointError, match="persist_every is 0; expected at least 1"):
        unickpt.MemoryTier(persist_every=0)
    with pytest.raises(unickpt.CheckpointError, match="replicas is 0"):
        unickpt.MemoryTier(replicas=0)


def _store(ckpt: unickpt.Checkpointer) -> MemoryStore:
    """The memory folder a Checkpointer's tier is bound to (after its first save)."""
    store = ckpt._tier.store  # type: ignore[union-attr]
    assert store is not None
    return store


def _state(step: int) -> dict[str, object]:
    return {"w": torch.arange(5000, dtype=torch.float64) * step, "step": step}


def _equal(a: dict[str, object], step: int) -> bool:
    want = _state(step)
    return torch.equal(a["w"], want["w"]) and a["step"] == step  # type: ignore[arg-type]


def test_memory_saves_bounded_persisted_to_any_backend(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    root = "memory://unickpt-tier-test/run"
    tier = unickpt.MemoryTier(persist_every=2, replicas=1, dir=shm)
    ckpt = unickpt.Checkpointer(root, keep_last=2, memory=tier)
    for step in range(1, 6):
        ckpt.save(step, _state(step)).wait()
        store = _store(ckpt)
        assert store.committed()[-1] == step and len(store.steps()) <= 2
        persisted(ckpt)  # a persist as fast as the saves: none of them waits for one
    assert ckpt.steps() == [2, 4]  # through the storage API (fsspec's memory file system)
    dest = _state(0)
    assert ckpt.load_latest(dest) == 5 and _equal(dest, 5)
    assert ckpt.last_restore is not None and ckpt.last_restore.source == "memory"
    stats = ckpt.memory_stats
    assert stats is not None and (stats.saves, stats.persists, stats.persist_waits) == (5, 2, 0)
    ckpt.close()
    assert ckpt.steps() == [4, 5] and not shm.exists()
    again = unickpt.Checkpointer(root, memory=tier)
    dest = _state(0)
    assert again.load_latest(dest) == 5 and _equal(dest, 5)
    assert again.last_restore is not None and again.last_restore.source == "storage"


def test_saves_write_over_the_retired_checkpoints_files(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    tier = unickpt.MemoryTier(persist_every=100, replicas=1, dir=shm)
    root = tmp_path / "root"
    ckpt = unickpt.Checkpointer(root, memory=tier)

    def data_inode(step: int) -> tuple[int, int]:
        store = _store(ckpt)
        (name,) = [n for n in os.listdir(store.step_path(step)) if n.startswith("data-")]
        st = os.stat(store.step_path(step) / name)
        return st.st_ino, st.st_size

    inodes = {}
    for step, n in {1: 5000, 2: 5000, 3: 1000, 4: 9000}.items():
        ckpt.save(step, {"w": torch.arange(n, dtype=torch.float64) * step}).wait()
        inodes[step] = data_inode(step)
    # each save wrote over the file of the checkpoint it retired (its pages reused), cut or
    # grown to its own size
    assert inodes[3][0] == inodes[1][0] and inodes[4][0] == inodes[2][0]
    assert inodes[3][1] < inodes[1][1] < inodes[4][1]
    dest = {"w": torch.zeros(9000, dtype=torch.float64)}
    assert ckpt.load_latest(dest) == 4 and torch.equal(dest["w"], torch.arange(9000.0) * 4)
    ckpt.close()
    assert not shm.exists()


def test_spares_fit_the_file_being_written(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, RootIdentity(str(tmp_path / "root"), "a1"))
    for step, size in ((1, 300), (1, 100), (2, 200)):
        folder = store.step_path(step)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"data-ab-{size}.bin").write_bytes(bytes(size))
    assert store.retire({2}) == [1] and store.steps() == [2]
    dest = tmp_path / "new.bin"
    assert store.take_spare(dest, 150) and dest.stat().st_size == 300
    assert store.take_spare(dest, 150) and dest.stat().st_size == 100  # the largest left
    assert not store.take_spare(dest, 150)


class _GatedStorage(LocalStorage):
    """Storage whose files are created only once ``gate`` is open."""

    def __init__(self, path: Path, gate: threading.Event) -> None:
        super().__init__(path)
        self.gate = gate

    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        self.gate.wait(120)
        return super().create(name, part_sizes)

    def child(self, name: str) -> LocalStorage:
        return _GatedStorage(self._path(name), self.gate)


def _open_when_warned(record: Any, gate: threading.Event, match: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(match in str(w.message) for w in record):
        time.sleep(0.01)
    gate.set()


def test_a_running_persist_is_waited_for_never_dropped(tmp_path: Path) -> None:
    tier = unickpt.MemoryTier(persist_every=1, replicas=1, dir=tmp_path / "shm")
    gate = threading.Event()  # the first persist writes nothing until a save has waited for it
    ckpt = unickpt.Checkpointer(_GatedStorage(tmp_path / "store", gate), memory=tier)
    match = "waiting for the persist of step"
    with pytest.warns(UserWarning, match=match) as record:
        opener = threading.Thread(target=_open_when_warned, args=(record, gate, match))
        opener.start()
        for step in range(1, 5):
            ckpt.save(step, _state(step))
        ckpt.close()
        opener.join()
    stats = ckpt.memory_stats
    assert stats is not None and stats.persist_waits >= 1 and stats.persists == 4
    assert ckpt.steps() == [1, 2, 3, 4]


def test_guard_persists_on_an_exception_and_reraises(tmp_path: Path) -> None:
    tier = unickpt.MemoryTier(persist_every=100, replicas=1, dir=tmp_path / "shm")
    ckpt = unickpt.Checkpointer(tmp_path / "store", memory=tier)
    with pytest.raises(RuntimeError, match="loss is nan"), ckpt.guard():
        for step in range(1, 4):
            ckpt.save(step, _state(step))
        raise RuntimeError("loss is nan")
    assert ckpt.steps() == [3]
    fresh = unickpt.Checkpointer(
        tmp_path / "store", memory=unickpt.MemoryTier(dir=tmp_path / "empty")
    )
    dest = _state(0)
    assert fresh.load_latest(dest) == 3 and _equal(dest, 3)
    assert os.listdir(tmp_path / "shm")  # the guard persists; it does not free the memory
