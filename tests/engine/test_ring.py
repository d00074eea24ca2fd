"""Bounded staging: asynchronous saves through a ring of at most ``staging_bytes`` of host memory.

Writes are held back by a gate on real local files, so what the copy can and cannot have done
when the test acts is fixed by the ring's size, not by timing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from tests.distributed import run_ranks
from unickpt.errors import CheckpointError, CheckpointNotFoundError
from unickpt.saving.queue import QUEUE
from unickpt.storage.base import WriteHandle
from unickpt.storage.local import LocalStorage, LocalWriteHandle

MiB = 1 << 20


class GatedHandle(LocalWriteHandle):
    def __init__(self, path: Path, sizes: Sequence[int], storage: GatedStorage) -> None:
        super().__init__(path, sizes)
        self.storage = storage

    def write_part(self, index: int, buffers: Sequence[memoryview]) -> None:
        if not self.storage.gate.wait(120):
            raise AssertionError("the gate was never opened")
        if index == self.storage.fail_part:
            raise CheckpointError(f"injected failure writing part {index} (503 Slow Down)")
        super().write_part(index, buffers)
        self.storage.parts_written += 1


class GatedStorage(LocalStorage):
    """A local folder whose data-file parts wait for ``gate`` (and part ``fail_part`` fails)."""

    def __init__(self, path: str | Path, open_gate: bool = False) -> None:
        super().__init__(path)
        self.gate = threading.Event()
        if open_gate:
            self.gate.set()
        self.fail_part: int | None = None
        self.parts_written = 0

    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        self.ensure_root()
        return GatedHandle(self._path(name), part_sizes, self)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a": torch.randn(2_000_000, generator=g),  # 8 MB: cut into parts
        "b": torch.randn(1500, 1000, generator=g).t(),  # 6 MB, not contiguous
        "c": torch.randn(700, 300, generator=g).to(torch.bfloat16),
        "d": torch.randint(0, 1 << 40, (300_000,), generator=g),
        "e": torch.empty(0, 5),
        "f": torch.tensor(3.5),
    }


def _load(path: str | Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.full_like(v, -1) for k, v in like.items()}
    unickpt.load(path, out)
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("background", [False, True])
def test_saves_through_rings_of_every_size_hold_every_value(
    tmp_path: Path, background: bool
) -> None:
    state = _state()
    total = sum(v.nbytes for v in state.values())
    for i, budget in enumerate([total // 4, total // 8, 2 * MiB, 3 * MiB + 4096]):
        QUEUE.arena.release()
        fut = unickpt.async_save(
            tmp_path / f"s{i}", state, staging_bytes=budget, zero_stall=background
        )
        fut.wait()
        assert QUEUE.arena.capacity_bytes == budget  # the ring is all the staging memory taken
        _assert_equal(_load(tmp_path / f"s{i}", state), state)
    QUEUE.arena.release()


def test_a_plain_async_save_returns_once_all_but_the_ring_is_written(tmp_path: Path) -> None:
    state = _state()
    storage = GatedStorage(tmp_path / "ckpt", open_gate=True)
    fut = unickpt.async_save(storage, state, staging_bytes=2 * MiB)
    assert fut.snapshot_done()  # the call returned: every byte is copied
    total_parts = storage.parts_written
    fut.wait()
    assert total_parts > 0  # the ring could not hold the state: parts were written meanwhile
    _assert_equal(_load(tmp_path / "ckpt", state), state)


def test_the_optimizer_step_waits_for_the_staged_copy_and_the_values_of_the_call_are_saved(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 1000))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 1000)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    storage = GatedStorage(tmp_path / "ckpt")
    fut = unickpt.async_save(storage, {"model": model}, staging_bytes=2 * MiB, zero_stall=True)
    assert not fut.snapshot_done()  # 8 MB through a 2 MiB ring, no part written yet
    threading.Timer(0.3, storage.gate.set).start()
    opt.step()  # waits for the copy, which waits for the writes the gate holds back
    assert fut.snapshot_done()
    fut.wait()
    after = model.state_dict()
    assert not torch.equal(after["0.weight"], before["0.weight"])
    loaded = {k: torch.zeros_like(v) for k, v in before.items()}
    unickpt.load(tmp_path / "ckpt", {"model": loaded})
    _assert_equal(loaded, before)


def test_an_in_place_change_before_its_copy_fails_the_staged_save_naming_the_key(
    tmp_path: Path,
) -> None:
    state = {"w": torch.ones(2_000_000), "v": torch.ones(2_000_000)}  # 8 MB each
    storage = GatedStorage(tmp_path / "ckpt")
    fut = unickpt.async_save(storage, state, staging_bytes=4 * MiB, zero_stall=True)
    state["v"].add_(1)  # 'v' starts 8 MB into the file: not copied while the writes wait
    storage.gate.set()
    with pytest.raises(CheckpointError, match="'v'"):
        fut.wait()
    assert fut.snapshot_done()
    with pytest.raises(CheckpointNotFoundError):
        unickpt.load(tmp_path / "ckpt", {"w": torch.zeros(2_000_000), "v": torch.zeros(2_000_000)})


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_write_ends_the_copy_commits_nothing_and_the_next_save_works(
    tmp_path: Path, background: bool
) -> None:
    state = _state()
    storage = GatedStorage(tmp_path / "bad", open_gate=True)
    storage.fail_part = 2
    fut = unickpt.async_save(storage, state, staging_bytes=2 * MiB, zero_stall=background)
    with pytest.raises(CheckpointError, match="injected failure writing part 2"):
        fut.wait()
    assert fut.snapshot_done()  # an optimizer step would not hang
    assert not (tmp_path / "bad").exists() or not any(
        p.name.startswith("data-") for p in (tmp_path / "bad").iterdir()
    )
    with pytest.raises(CheckpointNotFoundError):
        _load(tmp_path / "bad", state)
    unickpt.async_save(tmp_path / "good", state, staging_bytes=2 * MiB).wait()
    _assert_equal(_load(tmp_path / "good", state), state)


def test_a_checkpointer_saves_within_its_staging_budget(tmp_path: Path) -> None:
    state = _state()
    QUEUE.arena.release()
    with unickpt.Checkpointer(tmp_path / "run", staging_bytes=2 * MiB, keep_last=2) as ckpt:
        for step in range(3):
            state["a"].add_(1)
            ckpt.save(step, state).wait()
        assert QUEUE.arena.capacity_bytes == 2 * MiB
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.load_latest(out) == 2
    _assert_equal(out, state)
    QUEUE.arena.release()


def test_a_ring_smaller_than_the_storage_parts_is_refused_with_the_budget_it_needs(
    tmp_path: Path,
) -> None:
    storage = GatedStorage(tmp_path / "ckpt", open_gate=True)
    storage.min_part_bytes = 5 * MiB  # as an object store's multipart upload
    fut = unickpt.async_save(storage, _state(), staging_bytes=2 * MiB)
    with pytest.raises(CheckpointError, match="pass staging_bytes of at least"):
        fut.wait()
    assert not (tmp_path / "ckpt" / "COMMIT").exists()


@pytest.mark.parametrize(
    ("value", "found"),
    [
        (0, "staging_bytes is 0; expected at least two checksum segments"),
        ("1GB", "staging_bytes is '1GB'; expected a number of bytes"),
    ],
)
def test_a_bad_staging_budget_is_refused(tmp_path: Path, value: object, found: str) -> None:
    with pytest.raises(CheckpointError, match=found):
        unickpt.async_save(tmp_path / "x", _state(), staging_bytes=value)  # type: ignore[arg-type]


def _staged_on_ranks(rank: int, world: int, root: str, fail: bool) -> dict[str, Any]:
    """Each rank saves its rows of 'w' and its own 'r{rank}' through a 2 MiB ring; with
    ``fail``, rank 1's third part fails."""
    full = torch.arange(4_000_000, dtype=torch.float32).reshape(4000, 1000)
    rows = full[rank * 2000 : (rank + 1) * 2000]
    state = {
        "w": unickpt.ShardedTensor(rows, (4000, 1000), (rank * 2000, 0)),
        f"r{rank}": unickpt.PerRank(torch.full((500_000,), float(rank))),
    }
    storage = GatedStorage(f"{root}/ckpt", open_gate=True)
    if fail and rank == 1:
        storage.fail_part = 2
    fut = unickpt.async_save(storage, state, staging_bytes=2 * MiB, zero_stall=True)
    try:
        fut.wait()
    except CheckpointError as e:
        return {"error": str(e), "snapshot_done": fut.snapshot_done()}
    return {"error": None, "snapshot_done": fut.snapshot_done()}


def test_ranks_save_through_their_rings_and_fail_together(tmp_path: Path) -> None:
    ok = run_ranks(2, _staged_on_ranks, str(tmp_path / "ok"), False)
    assert ok == [{"error": None, "snapshot_done": True}] * 2
    whole = torch.zeros(4000, 1000)
    unickpt.load(tmp_path / "ok" / "ckpt", {"w": whole}, strict=False)
    assert torch.equal(whole, torch.arange(4_000_000, dtype=torch.float32).reshape(4000, 1000))
    bad = run_ranks(2, _staged_on_ranks, str(tmp_path / "bad"), True)
    assert all(r["snapshot_done"] for r in bad)
    assert all("injected failure writing part 2" in r["error"] for r in bad), bad
    assert not (tmp_path / "bad" / "ckpt" / "COMMIT").exists()
