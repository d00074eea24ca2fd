"""Leaving a membership in a process that stays, and joining the next one: unickpt's groups
and caches, the root's lock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import unickpt
from tests.distributed import run_ranks
from unickpt.errors import CheckpointLockedError, DistributedCheckpointError
from unickpt.launch.teardown import tear_down
from unickpt.storage.local import LocalStorage


def _state(rank: int, value: float) -> dict[str, Any]:
    block = torch.full((2, 3), value + rank)
    return {"w": unickpt.ShardedTensor(block, (4, 3), (2 * rank, 0)), "step": int(value)}


def _leave_and_join(rank: int, world: int, root: str, stores: str) -> dict[str, Any]:
    old = unickpt.Checkpointer(root, keep_last=3)
    old.save(1, _state(rank, 1.0))
    old.wait()
    tear_down(30.0)
    seen: dict[str, Any] = {"initialized": dist.is_initialized()}
    try:
        old.save(2, _state(rank, 2.0))
    except DistributedCheckpointError as e:
        seen["old"] = str(e)
    store = dist.FileStore(f"{stores}/epoch-1", world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    new = unickpt.Checkpointer(root, keep_last=3)  # rank 0 takes over the lock it holds
    new.save(2, _state(rank, 2.0))
    new.wait()
    old.close()  # its release does nothing: the lock is the new Checkpointer's now
    if rank == 0:
        try:
            LocalStorage(root).acquire_lock()
        except CheckpointLockedError:
            seen["held after the old close"] = True
    loaded = _state(rank, 0.0)
    seen["step"] = new.load_latest(loaded)
    seen["w"] = loaded["w"].local.tolist()
    new.close()
    if rank == 0:
        LocalStorage(root).acquire_lock()()  # released by the new close
    return seen


def test_a_process_leaves_its_membership_and_joins_the_next(tmp_path: Path) -> None:
    stores = tmp_path / "stores"
    stores.mkdir()
    root = str(tmp_path / "root")
    results = run_ranks(2, _leave_and_join, root, str(stores))
    for rank, seen in enumerate(results):
        assert seen.pop("initialized") is False
        assert "the job's membership changed" in seen.pop("old")
        assert seen.pop("held after the old close", None) is (True if rank == 0 else None)
        assert seen == {"step": 2, "w": [[2.0 + rank] * 3] * 2}
    assert unickpt.Checkpointer(root).steps() == [1, 2]


def test_recover_outside_unickpt_run_calls_train_once_in_a_group(tmp_path: Path) -> None:
    def train(x: int) -> tuple[int, int]:
        return x, dist.get_world_size()

    assert unickpt.recover(train, 7) == (7, 1)
    assert not dist.is_initialized()
