"""Where the root and the tiers meet: agreed decisions, safe retention, an honest load_latest,
memory folders bound to the root's identity, persists that fail alone, failed saves that take
their files with them. Real saves on real files; transient errors from a storage that fails on
command (:mod:`.faulty`); distributed cases in real spawned gloo ranks."""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import unickpt
from unickpt.errors import CheckpointCorruptError, CheckpointError
from unickpt.root import ROOT_ID_FILE, step_name

from ..distributed import context, run_ranks, start_process
from .faulty import faulty
from .takeover import check_the_lock_was_taken, saves_after_the_lock_is_taken


def _state(step: int, n: int = 4096) -> dict[str, Any]:
    return {"w": torch.full((n,), float(step)), "frozen": torch.arange(n, dtype=torch.float64)}


def _zeros(n: int = 4096) -> dict[str, Any]:
    return {"w": torch.zeros(n), "frozen": torch.zeros(n, dtype=torch.float64)}


def _holds(state: dict[str, Any], step: int) -> bool:
    want = _state(step, state["w"].numel())
    return all(torch.equal(state[k], want[k]) for k in want)


# -- 1. ranks stay in step when the coordinator's read fails -----------------------------------


def _saves_after_a_coordinator_failure(rank: int, world: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("incremental", "lock", "debris"):
        storage, faults = faulty(Path(folder) / mode)
        ckpt = unickpt.Checkpointer(storage, incremental=mode == "incremental", keep_last=3)
        outcomes = []
        for step in range(1, 6):
            if rank == 0 and step == 2 and mode == "incremental":
                # the coordinator's listings before the save: the debris scan (logged), then the
                # steps an incremental save may refer to (fails the save on every rank)
                faults.fail("list_names", times=2)
            if rank == 0 and step == 1 and mode == "lock":
                faults.fail("acquire_lock")
            if rank == 0 and step == 3 and mode == "debris":
                (Path(folder) / mode / step_name(99)).mkdir()  # debris to look at
                faults.fail("size", "step-000000099")
            try:
                ckpt.save(step, _state(step)).wait()
                outcomes.append("ok")
            except CheckpointError as e:
                outcomes.append("injected failure" if "injected failure" in str(e) else str(e))
            dist.all_reduce(torch.ones(1))  # the training's own collective between saves
        ckpt.close()
        dest = _zeros()
        last = unickpt.Checkpointer(storage).load_latest(dest)
        out[mode] = (outcomes, ckpt.steps(), last, _holds(dest, 5))
    return out


def test_a_coordinator_failure_fails_the_save_on_every_rank_and_the_next_saves_go_on(
    tmp_path: Path,
) -> None:
    results = run_ranks(2, _saves_after_a_coordinator_failure, str(tmp_path), timeout_s=240)
    assert results[0] == results[1]
    ok = ["ok"] * 5
    assert results[0]["incremental"] == (
        ["ok", "injected failure", "ok", "ok", "ok"],
        [1, 3, 4, 5],  # step 1 holds the "frozen" bytes the later steps refer to
        5,
        True,
    )
    assert results[0]["lock"] == (["injected failure", *ok[1:]], [3, 4, 5], 5, True)
    # a cleanup that cannot look is logged, the save goes on on every rank, and the next
    # save's cleanup removes the debris
    assert results[0]["debris"] == (ok, [3, 4, 5], 5, True)
    assert not (tmp_path / "debris" / step_name(99)).exists()


# -- 2. retention keeps what it cannot prove unreferenced -------------------------------------


def test_retention_keeps_every_step_when_a_reference_cannot_be_read(tmp_path: Path) -> None:
    storage, faults = faulty(tmp_path / "root")
    ckpt = unickpt.Checkpointer(storage, keep_last=2, incremental=True, full_every=100, mode="sync")
    ckpt.save(1, _state(1))
    ckpt.save(2, _state(2))  # refers to step 1's "frozen"
    rule = faults.fail("read_bytes", "metadata-", times=4)  # a 503 burst during retention
    ckpt.save(3, _state(3))
    assert rule.hits, "retention did not read the references"
    assert ckpt.steps() == [1, 2, 3]  # step 1 was not proven unreferenced: kept
    faults.armed = False
    ckpt.save(4, _state(4))
    ckpt.close()
    assert ckpt.steps() == [1, 3, 4]  # 1 holds bytes 3 and 4 stand on; 2 is gone
    for step in ckpt.steps():
        dest = _zeros()
        unickpt.load(ckpt.path(step), dest)
        assert _holds(dest, step), step


# -- 3. load_latest: None only for an empty root -------------------------------------------


def _flip_a_byte(folder: Path) -> None:
    (data,) = [p for p in folder.iterdir() if p.name.startswith("data-")]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_load_latest_raises_naming_every_step_when_none_loads(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ckpt = unickpt.Checkpointer(root, incremental=True, full_every=100, mode="sync")
    assert ckpt.load_latest(_zeros()) is None  # an empty root: nothing to resume
    for step in (1, 2, 3):
        ckpt.save(step, _state(step, 1 << 18))
    ckpt.close()
    _flip_a_byte(root / step_name(1))  # the base every later step stands on
    reader = unickpt.Checkpointer(root)
    with (
        pytest.warns(UserWarning, match="falling back"),
        pytest.raises(CheckpointCorruptError) as caught,
    ):
        reader.load_latest(_zeros(1 << 18))
    message = str(caught.value)
    assert "no checkpoint of" in message and "tried, newest first" in message
    lines = [line for line in message.splitlines() if line.startswith("  step ")]
    assert [line.split()[1] for line in lines] == ["3", "2", "1"]
    assert "checksum" in message
    assert "may hold values that these loads wrote" in message


def _writer(root: str, stop: Any) -> None:
    """Saves step after step with keep_last=1 until told to stop (retention deletes each step
    as the next commits)."""
    ckpt = unickpt.Checkpointer(root, keep_last=1, mode="sync")
    step = 0
    while not stop.is_set() and step < 10_000:
        step += 1
        ckpt.save(step, _state(step, 1 << 20))
    ckpt.close()


def test_a_reader_beside_a_writer_with_keep_last_1_always_gets_a_whole_step(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    stop = context().Event()
    writer = start_process(_writer, str(root), stop)
    reader = unickpt.Checkpointer(root)
    loads: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not list(root.glob("step-*/COMMIT")) and time.monotonic() < deadline:
            time.sleep(0.05)  # the writer's first commit (keep_last=1: any step's)
        while writer.is_alive() and time.monotonic() < deadline and len(loads) < 30:
            dest = _zeros(1 << 20)
            step = reader.load_latest(dest)
            assert step is not None
            assert _holds(dest, step), step
            loads.append(step)
    finally:
        stop.set()
        writer.join(120)
    assert writer.exitcode == 0 and len(loads) == 30
    assert loads == sorted(loads)


# -- 4. a memory folder is bound to its root's identity ---------------------------------------


def test_memory_checkpoints_belong_to_one_root(tmp_path: Path, monkeypatch: Any) -> None:
    tier = unickpt.MemoryTier(persist_every=100, replicas=1, dir=tmp_path / "shm")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    first = unickpt.Checkpointer("ckpt", memory=tier)
    for step in (49, 50):
        first.save(step, _state(step)).wait()  # in memory only: persist_every=100
    assert (tmp_path / "a" / "ckpt" / ROOT_ID_FILE).is_file()
    # a second job, elsewhere, with the same root as typed
    monkeypatch.chdir(tmp_path / "b")
    second = unickpt.Checkpointer("ckpt", memory=tier)
    assert second.load_latest(_zeros()) is None
    second.save(1, _state(1)).wait()
    second.save(2, _state(2)).wait()
    second.close()
    # the first job's memory checkpoints are still there, and still its own
    monkeypatch.chdir(tmp_path / "a")
    dest = _zeros()
    again = unickpt.Checkpointer("ckpt", memory=tier)
    assert again.load_latest(dest) == 50 and _holds(dest, 50)
    assert again.last_restore is not None and again.last_restore.source == "memory"
    # the user deletes the root to start over: the old memory checkpoints are not resumed
    shutil.rmtree(tmp_path / "a" / "ckpt")
    fresh = unickpt.Checkpointer("ckpt", memory=tier)
    assert fresh.load_latest(_zeros()) is None
    fresh.save(1, _state(1)).wait()
    fresh.close()
    dest = _zeros()
    assert unickpt.Checkpointer("ckpt").load_latest(dest) == 1 and _holds(dest, 1)
    first.wait()
    assert first._release is not None
    first._release()  # the first job "crashed" holding its lock; free it for the next test


# -- 6. a failed persist fails no later save -------------------------------------------------


def test_a_failed_persist_is_counted_and_later_saves_and_the_last_persist_go_on(
    tmp_path: Path,
) -> None:
    storage, faults = faulty(tmp_path / "root")
    tier = unickpt.MemoryTier(persist_every=1, replicas=1, dir=tmp_path / "shm")
    ckpt = unickpt.Checkpointer(storage, memory=tier, keep_last=2)
    ckpt.save(1, _state(1)).wait()
    deadline = time.monotonic() + 60  # step 1's persist runs in a thread of its own: let it end
    while ckpt.memory_stats.persists < 1 and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.01)
    rule = faults.fail("create", "data-", times=1)  # the persist of step 2 fails
    ckpt.save(2, _state(2)).wait()
    with pytest.warns(UserWarning, match="persisting memory step 2 .* failed"):
        ckpt.save(3, _state(3)).wait()
        ckpt.save(4, _state(4)).wait()
    assert rule.hits
    stats = ckpt.memory_stats
    assert stats is not None and stats.persist_failures == 1 and stats.saves == 4
    ckpt.close()
    assert ckpt.steps() == [3, 4]
    dest = _zeros()
    assert unickpt.Checkpointer(storage).load_latest(dest) == 4 and _holds(dest, 4)


# -- 9. failed saves take their files with them; referenced bytes are never replaced -----------


def test_a_save_that_fails_at_its_commit_leaves_no_files_and_the_old_checkpoint(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ckpt"
    storage, faults = faulty(folder)
    unickpt.save(storage, _state(1))
    before = sorted(os.listdir(folder))
    for written in ("metadata-", "COMMIT"):
        faults.fail("write_atomic", written)
        with pytest.raises(CheckpointError, match="injected failure"):
            unickpt.save(storage, _state(2), overwrite=True)
        assert sorted(os.listdir(folder)) == before, written
        dest = _zeros()
        unickpt.load(folder, dest)
        assert _holds(dest, 1)


def test_saving_over_a_step_that_others_refer_to_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ckpt = unickpt.Checkpointer(root, incremental=True, full_every=100, mode="sync")
    ckpt.save(1, _state(1))
    ckpt.save(2, _state(2))
    ckpt.close()
    for again in (
        lambda: unickpt.save(root / step_name(1), _state(7), overwrite=True),
        lambda: unickpt.Checkpointer(root, mode="sync").save(1, _state(7)),
    ):
        with pytest.raises(CheckpointError, match=r"incremental checkpoints in step-000000002"):
            again()
    for step in (1, 2):
        dest = _zeros()
        unickpt.load(root / step_name(step), dest)
        assert _holds(dest, step)


# -- 7. a writer whose lock was taken stops saving, on every rank ------------------------------


def test_a_writer_whose_lock_file_was_replaced_stops_saving_on_every_rank(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "run")
    results = run_ranks(2, saves_after_the_lock_is_taken, root, timeout_s=240)
    host = re.escape(socket.gethostname())
    taken = (
        f"{re.escape(root)}: this writer \\(pid \\d+ on {host}\\) no longer holds its lock: "
        f"the file was replaced \\(now held by pid \\d+ on {host}\\)"
    )
    check_the_lock_was_taken(results, root, taken)
