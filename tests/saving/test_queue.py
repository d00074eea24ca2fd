"""The save queue: saves from several threads at once each commit their own values, and the
staging memory can be allocated before the first save."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.saving.queue import QUEUE

MiB = 1 << 20
ROUNDS = 16


def _state(name: str, step: int) -> dict[str, torch.Tensor]:
    """Values of one Checkpointer at one step, unlike every other's (4 MB of float32 and
    more of other dtypes)."""
    g = torch.Generator().manual_seed(hash((name, step)) % (1 << 31))
    return {
        "w": torch.randn(1_000_000, generator=g),
        "t": torch.randn(600, 900, generator=g).t(),  # not contiguous
        "h": torch.randn(300_000, generator=g).to(torch.bfloat16),
        "n": torch.randint(0, 1 << 40, (1000,), generator=g),
    }


def _loaded(ckpt: unickpt.Checkpointer, step: int, like: dict[str, torch.Tensor]) -> dict:
    out = {k: torch.full_like(v, -7) for k, v in like.items()}
    unickpt.load(ckpt.path(step), out)
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _saver(name: str, ckpt: unickpt.Checkpointer, barrier: threading.Barrier, errors: list) -> None:
    try:
        for step in range(ROUNDS):
            state = _state(name, step)
            barrier.wait()  # both threads call save at about the same moment
            ckpt.save(step, state).wait()
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)
        barrier.abort()


# Small segments, so that a ring of a few hundred KiB holds several parts and a save of a
# few MB passes through it in dozens of them.
CONFIG = unickpt.get_config(
    segment_bytes=64 * 1024, window_bytes=1 * MiB, small_chunk_bytes=64 * 1024
)


@pytest.mark.parametrize(
    ("model_mode", "ema_mode", "staging_bytes"),
    [
        ("async", "async", None),
        ("async", "async", 512 * 1024),
        ("zero_stall", "async", None),
        ("zero_stall", "async", 512 * 1024),
    ],
    ids=["snapshot", "ring", "zero-stall", "zero-stall-ring"],
)
def test_two_checkpointers_saving_from_two_threads_each_commit_their_own_values(
    tmp_path: Path, model_mode: str, ema_mode: str, staging_bytes: int | None
) -> None:
    """A model and its EMA copy saved by two Checkpointers from two threads released by a
    barrier, round after round: every checkpoint holds its own values, bitwise."""
    modes = {"model": model_mode, "ema": ema_mode}
    ckpts = {
        name: unickpt.Checkpointer(
            tmp_path / name, mode=mode, staging_bytes=staging_bytes, config=CONFIG
        )
        for name, mode in modes.items()
    }
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []
    switch_s = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads take turns often, in every phase of their saves
    threads = [
        threading.Thread(target=_saver, args=(name, ckpt, barrier, errors))
        for name, ckpt in ckpts.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sys.setswitchinterval(switch_s)
    assert not errors, errors
    for name, ckpt in ckpts.items():
        assert ckpt.steps() == list(range(ROUNDS))
        for step in range(ROUNDS):
            want = _state(name, step)
            got = _loaded(ckpt, step, want)
            for k in want:
                assert _bits(got[k]) == _bits(want[k]), (name, step, k)
        ckpt.close()


def test_staging_prepared_ahead_is_the_room_the_first_save_copies_into(tmp_path: Path) -> None:
    """After ``prepare_staging`` the arena holds room for the whole snapshot, so the first
    asynchronous save allocates nothing in its call; a budget bounds what is prepared."""
    QUEUE.arena.release()
    state = _state("model", 0)
    with unickpt.Checkpointer(tmp_path / "run") as ckpt:
        held = ckpt.prepare_staging(state).wait()
        assert held >= sum(v.nbytes for v in state.values())
        assert QUEUE.arena.capacity_bytes == held
        allocations = QUEUE.arena.allocations
        ckpt.save(0, state).wait()
        assert QUEUE.arena.allocations == allocations  # the save took the prepared room
        assert QUEUE.arena.capacity_bytes == held
        got = _loaded(ckpt, 0, state)
    for k in state:
        assert torch.equal(got[k], state[k]), k
    QUEUE.arena.release()
    allocations = QUEUE.arena.allocations
    assert unickpt.prepare_staging(state, staging_bytes=2 * MiB).wait() == 2 * MiB
    assert QUEUE.arena.capacity_bytes == 2 * MiB
    unickpt.async_save(tmp_path / "ring", state, staging_bytes=2 * MiB).wait()
    assert QUEUE.arena.allocations == allocations + 1
    assert QUEUE.arena.capacity_bytes == 2 * MiB
    QUEUE.arena.release()
    with unickpt.Checkpointer(tmp_path / "sync", mode="sync") as ckpt:
        assert ckpt.prepare_staging(state).wait() == 0  # a synchronous save stages nothing
    assert QUEUE.arena.capacity_bytes == 0
