"""Failures in a 2-rank job: every rank raises, none hangs, nothing committed is lost.

Real gloo processes. A rank's write is made to fail for real by a file size limit
(``RLIMIT_FSIZE``) on that rank only; a dying rank calls ``os._exit``; a stuck rank waits on a
file while the other one runs into the collective timeout set by
``UNICKPT_COLLECTIVE_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import unickpt
from tests.distributed import run_ranks
from tests.integrity._helpers import debris, read_commit, same_tensor
from tests.integrity._procs import run_ranks_some_die

TIMEOUT_S = 4
Outcome = tuple[str, str, float]


class Stateful:
    """An object with state_dict/load_state_dict; ``fail`` runs inside state_dict."""

    def __init__(self, fail: Callable[[], None] | None = None) -> None:
        self.fail = fail
        self.value = 1

    def state_dict(self) -> dict[str, Any]:
        if self.fail is not None:
            self.fail()
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _sensor_offline() -> None:
    raise RuntimeError("sensor offline")


def _attempt(fn: Callable[[], Any]) -> Outcome:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


@contextlib.contextmanager
def _file_size_limit(nbytes: int, active: bool) -> Iterator[None]:
    """Files of this process cannot grow past ``nbytes`` (writes fail with EFBIG)."""
    if not active:
        yield
        return
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, previous)


def _state(rank: int, fill: float, obj: Stateful | None = None) -> dict[str, Any]:
    """A 64 KiB shard per rank, a replicated tensor, a per-rank value."""
    shard = torch.full((16, 1024), fill + rank, dtype=torch.float32)
    return {
        "w": unickpt.ShardedTensor(shard, (32, 1024), (16 * rank, 0)),
        "bias": torch.full((8,), fill),
        "rank": unickpt.PerRank(f"rank {rank} at {fill}"),
        "obj": obj if obj is not None else Stateful(),
    }


def _holds(state: dict[str, Any], rank: int, fill: float) -> bool:
    expected = _state(rank, fill)
    return (
        same_tensor(state["w"].local, expected["w"].local)
        and same_tensor(state["bias"], expected["bias"])
        and state["rank"].value == expected["rank"].value
    )


def _load_holds(path: str, rank: int, fill: float) -> bool:
    state = _state(rank, -1.0)
    unickpt.load(path, state)
    return _holds(state, rank, fill)


def _failing_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    path = f"{root}/ckpt"

    obj = Stateful(_sensor_offline if rank == 1 else None)
    out["state_dict raises"] = _attempt(lambda: unickpt.save(f"{root}/a", _state(rank, 1, obj)))
    out["state_dict raises: committed"] = os.path.exists(f"{root}/a/COMMIT")

    for name, conflict in _conflicts(rank).items():
        where = f"{root}/{name}"
        out[name] = _attempt(lambda w=where, c=conflict: unickpt.save(w, c))  # type: ignore[misc]

    keys = {"m": {"a": torch.ones(3), ("b" if rank == 0 else "c"): torch.full((3,), float(rank))}}
    out["keys differ: saved"] = _attempt(lambda: unickpt.save(f"{root}/k", keys))
    mine = {"m": {k: torch.zeros(3) for k in keys["m"]}}
    unickpt.load(f"{root}/k", mine)
    out["keys differ: loaded"] = all(same_tensor(mine["m"][k], v) for k, v in keys["m"].items())
    only_a = {"m": {"a": torch.ones(3)}}
    out["no rank asks for a key"] = _attempt(lambda: unickpt.load(f"{root}/k", only_a))

    unickpt.save(path, _state(rank, 1.0))
    with _file_size_limit(4096, active=rank == 1):
        out["write fails"] = _attempt(lambda: unickpt.save(path, _state(rank, 2), overwrite=True))
    out["write fails: old loads"] = _load_holds(path, rank, 1.0)

    def async_overwrite() -> None:
        fut = unickpt.async_save(path, _state(rank, 3.0), overwrite=True)
        fut.wait()

    with _file_size_limit(4096, active=rank == 1):
        out["async write fails"] = _attempt(async_overwrite)
    out["async write fails: old loads"] = _load_holds(path, rank, 1.0)

    dist.barrier()
    victim = Path(path) / f"data-{read_commit(Path(path))['save_id']}-00001.bin"
    raw = victim.read_bytes()
    if rank == 0:
        victim.write_bytes(raw[:100] + bytes([raw[100] ^ 0x10]) + raw[101:])
    dist.barrier()
    out["rank 1 data damaged"] = _attempt(lambda: unickpt.load(path, _state(rank, 0.0)))
    dist.barrier()
    if rank == 0:
        victim.write_bytes(raw)
    dist.barrier()

    unickpt.save(path, _state(rank, 4.0), overwrite=True)
    out["after the failures"] = _load_holds(path, rank, 4.0)
    out["debris after the failures"] = debris(Path(path))
    return out


@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("ranks")
    return run_ranks(2, _failing_ranks, str(root), timeout_s=120)


def _each_rank(results: list[dict[str, Any]], name: str) -> list[Outcome]:
    return [r[name] for r in results]


def test_state_dict_failing_on_one_rank_raises_on_every_rank(failing: list[Any]) -> None:
    for kind, message, _ in _each_rank(failing, "state_dict raises"):
        assert kind == "DistributedCheckpointError"
        assert "planning the save failed on 1 of 2 ranks" in message
        assert "rank 1: RuntimeError: sensor offline" in message
    assert _each_rank(failing, "state_dict raises: committed") == [False, False]


def _conflicts(rank: int) -> dict[str, dict[str, Any]]:
    """States the two ranks cannot save together, by what is wrong."""
    flat = torch.arange(5.0)
    return {
        "overlap and gap": {"w": unickpt.ShardedTensor(flat, (10,), (0 if rank == 0 else 3,))},
        "flat overlap": {"w": unickpt.FlatShard(flat, (2, 5), 0 if rank == 0 else 3)},
        "shape differs": {"w": torch.ones(3 + rank)},
        "dtype differs": {"w": torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float16)},
        "kind differs": {
            "w": torch.ones(4) if rank == 0 else unickpt.ShardedTensor(torch.ones(2), (4,), (2,))
        },
        "tensor and value": {"w": torch.ones(2) if rank == 0 else 7},
    }


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "overlap and gap",
            "the shards of 'w' (global shape [10]) do not tile it: elements [3:5] "
            "are held by more than one shard (shards of ranks 0, 1)",
        ),
        (
            "flat overlap",
            "the shards of 'w' (global shape [2, 5]) do not tile it: elements "
            "[0:1, 3:5] are held by more than one shard",
        ),
        (
            "shape differs",
            "'w' is a plain tensor float32[4] on rank 1 but a plain tensor float32[3] on rank 0",
        ),
        (
            "dtype differs",
            "'w' is a plain tensor float16[3] on rank 1 but a plain tensor float32[3] on rank 0",
        ),
        (
            "kind differs",
            "'w' is a ShardedTensor block float32[4] on rank 1 but a plain tensor "
            "float32[4] on rank 0",
        ),
        ("tensor and value", "'w' is a plain value on rank 1 but a tensor on rank 0"),
    ],
)
def test_conflicting_ranks_fail_on_every_rank(failing: list[Any], case: str, message: str) -> None:
    outcomes = _each_rank(failing, case)
    for kind, text, _ in outcomes:
        assert kind == "CheckpointMismatchError", text
        assert "planning the save failed on 2 of 2 ranks:\n  ranks 0, 1: " in text, text
        assert message in text, text
    assert outcomes[0][1] == outcomes[1][1]


def test_ranks_with_different_keys_save_and_load(failing: list[Any]) -> None:
    assert [o[0] for o in _each_rank(failing, "keys differ: saved")] == ["ok", "ok"]
    assert _each_rank(failing, "keys differ: loaded") == [True, True]
    for kind, message, _ in _each_rank(failing, "no rank asks for a key"):
        assert kind == "CheckpointMismatchError"
        assert (
            "the checkpoint has keys that no rank's state asks for: 'm.b', 'm.c' (2 tensors"
            in message
        )


@pytest.mark.parametrize("which", ["write fails", "async write fails"])
def test_write_failing_on_one_rank_raises_everywhere_and_keeps_the_old(
    failing: list[Any], which: str
) -> None:
    for kind, message, _ in _each_rank(failing, which):
        assert kind == "DistributedCheckpointError"
        assert "saving failed on 1 of 2 ranks" in message
        assert "rank 1:" in message and "File too large" in message
    assert _each_rank(failing, f"{which}: old loads") == [True, True]


def test_damage_in_one_ranks_file_fails_every_rank(failing: list[Any]) -> None:
    for kind, message, _ in _each_rank(failing, "rank 1 data damaged"):
        assert kind == "CheckpointCorruptError"
        assert "rank 1" in message and "checksum mismatch" in message
    assert _each_rank(failing, "after the failures") == [True, True]
    assert _each_rank(failing, "debris after the failures") == [[], []]


def _dies_or_hangs(rank: int, world: int, root: str, how: str) -> Outcome:
    os.environ["UNICKPT_COLLECTIVE_TIMEOUT_S"] = str(TIMEOUT_S)
    release = Path(root) / "release"

    def stuck() -> None:
        while not release.exists():
            time.sleep(0.05)
        os._exit(5)

    if how == "dies in planning":
        obj = Stateful((lambda: os._exit(3)) if rank == 1 else None)
        outcome = _attempt(lambda: unickpt.save(f"{root}/c", _state(rank, 1.0, obj)))
    elif how == "hangs in planning":
        obj = Stateful(stuck if rank == 1 else None)
        outcome = _attempt(lambda: unickpt.save(f"{root}/c", _state(rank, 1.0, obj)))
    else:
        fut = unickpt.async_save(f"{root}/c", _state(rank, 1.0))
        if rank == 1:
            os._exit(4)
        outcome = _attempt(fut.wait)
    release.touch()
    return outcome


@pytest.fixture(scope="module", params=["dies in planning", "dies while writing", "hangs"])
def lost_rank(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    how = "hangs in planning" if request.param == "hangs" else request.param
    root = tmp_path_factory.mktemp("lost")
    t0 = time.monotonic()
    results = run_ranks_some_die(2, _dies_or_hangs, str(root), how, timeout_s=90)
    return how, results, time.monotonic() - t0, root


@pytest.mark.timeout(150)
def test_surviving_rank_raises_within_the_timeout(lost_rank: Any) -> None:
    how, results, _, root = lost_rank
    assert results[1][0] == "exit"
    kind, _, elapsed_s = results[0]
    assert kind != "ok", f"rank 0 finished a save its peer never took part in ({how})"
    assert elapsed_s < TIMEOUT_S + 10, f"rank 0 took {elapsed_s:.1f} s to notice ({how})"
    assert not (root / "c" / "COMMIT").exists()


def test_surviving_rank_raises_a_checkpoint_error(lost_rank: Any) -> None:
    _, results, _, _ = lost_rank
    kind, message, _ = results[0]
    assert kind in ("DistributedCheckpointError", "CheckpointError"), f"{kind}: {message}"
    assert "rank 1" in message
