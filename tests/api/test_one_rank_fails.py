"""An asynchronous save whose copy fails on one rank only (the staging memory cannot be had; a
zero-stall save's capture raises) fails on every rank, from ``wait()``, with that rank's error,
instead of leaving the others waiting in the write's gather for the collective timeout; the
next save goes on. Real gloo ranks; a collective timeout of 20 s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import unickpt
from tests.distributed import run_ranks
from unickpt.config import get_config
from unickpt.saving.queue import QUEUE, StagingArena


class _Unavailable(StagingArena):
    """Staging memory this rank cannot have (a host out of memory)."""

    def take(self, nbytes: int, pinned: bool, touch: bool = False) -> torch.Tensor:
        raise RuntimeError(f"injected failure: no memory for a snapshot of {nbytes} bytes")


class _Loader:
    """A stateful object whose state cannot be taken on rank 1."""

    def __init__(self, rank: int, fail: list[bool]) -> None:
        self.rank, self.fail = rank, fail

    def state_dict(self) -> dict[str, Any]:
        if self.rank == 1 and self.fail[0]:
            raise RuntimeError("injected failure: the data loader's state")
        return {"position": 7}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _saves(rank: int, world: int, folder: str) -> list[str]:
    config = get_config(collective_timeout_s=20)
    w = torch.full((4096,), float(rank))
    fail = [False]
    state = {
        "w": unickpt.ShardedTensor(w, (2 * 4096,), (rank * 4096,)),
        "data": _Loader(rank, fail),
    }
    outcomes = []
    for k, (zero_stall, broken) in enumerate(
        [(False, "arena"), (False, ""), (True, "capture"), (True, "")]
    ):
        if rank == 1 and broken == "arena":
            QUEUE.arena = _Unavailable()
        fail[0] = broken == "capture"
        try:
            fut = unickpt.async_save(f"{folder}/{k}", state, config=config, zero_stall=zero_stall)
            fut.wait()
            outcomes.append("saved")
        except unickpt.CheckpointError as e:
            outcomes.append(str(e))
        QUEUE.arena = StagingArena()
    return outcomes


def test_an_asynchronous_save_whose_copy_fails_on_one_rank_fails_on_every_rank(
    tmp_path: Path,
) -> None:
    results = run_ranks(2, _saves, str(tmp_path), timeout_s=240)
    assert results[0] == results[1]
    snapshot, after, capture, after_capture = results[0]
    assert snapshot == (
        "saving failed on 1 of 2 ranks:\n  rank 1: RuntimeError: injected failure: no memory "
        "for a snapshot of 16384 bytes"
    )
    assert capture == (
        "planning the save failed on 1 of 2 ranks:\n  rank 1: RuntimeError: injected failure: "
        "the data loader's state"
    )
    assert after == after_capture == "saved"
    assert not (tmp_path / "0" / "COMMIT").exists() and not (tmp_path / "2" / "COMMIT").exists()
