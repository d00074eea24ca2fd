"""Restores from a peer: into the state or through files loaded while they arrive; values,
healing, damage, failure."""

from __future__ import annotations

import multiprocessing
import shutil
import signal
import threading
from pathlib import Path

import pytest

import unickpt
from tests.distributed import run_ranks, start_ranks
from tests.tiers import workers
from unickpt.errors import DistributedCheckpointError
from unickpt.tiers.group import Arrivals

PIECE = 4096  # each rank's file (9600 bytes and more) arrives in several pieces
NODES = {0: "a", 1: "b"}


def _saved(tmp_path: Path) -> tuple[str, dict[int, str]]:
    """Steps 1-3 saved by two ranks on two nodes (step 2 persisted); the ranks killed."""
    root = str(tmp_path / "store")
    dirs = {0: str(tmp_path / "node-a"), 1: str(tmp_path / "node-b")}
    procs, _ = start_ranks(2, workers.save_steps, root, dirs, NODES, [1, 2, 3], 2)
    _kill(procs)
    assert unickpt.Checkpointer(root).steps() == [2]
    return root, dirs


def _kill(procs: list[multiprocessing.Process]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.join(30)
        assert p.exitcode == -signal.SIGKILL


def _step3(names: list[str]) -> list[str]:
    kinds = ("COMMIT", "metadata-", "data-", "index-")
    base = [n.rsplit("/", 1)[1] for n in names if "/step-000000003/" in n]
    return [n for n in base if n.startswith(kinds)]


def test_peer_restore_receives_into_the_state_and_leaves_the_node_folder(tmp_path: Path) -> None:
    """Same layout: the chunks go straight into the state tensors, in pieces and in runs of
    small chunks; no file is written, so the peer keeps serving them."""
    root, dirs = _saved(tmp_path)
    shutil.rmtree(dirs[1])  # node b is lost with its memory: rank 1 fetches both files
    rows = 2 * workers.ROWS
    results = run_ranks(2, workers.restart_in_pieces, root, dirs, NODES, rows, PIECE)
    assert [r[:2] for r in results] == [(3, "memory"), (3, "peer")]  # values checked bitwise
    a, b = (_step3(r[2]) for r in results)
    assert len(a) == 6  # commit, metadata, both ranks' data and index files
    assert b == [n for n in a if n.startswith(("COMMIT", "metadata-"))]
    again = run_ranks(2, workers.restart_in_pieces, root, dirs, NODES, rows, PIECE)
    assert [r[:2] for r in again] == [(3, "memory"), (3, "peer")]


def test_resharded_peer_restore_loads_while_arriving_and_heals_the_node(tmp_path: Path) -> None:
    """Split by columns, each rank needs part of every saved row: whole files are fetched into
    the node's folder, loaded while they arrive, and the node holds them afterwards."""
    root, dirs = _saved(tmp_path)
    shutil.rmtree(dirs[1])
    rows = 2 * workers.ROWS
    results = run_ranks(2, workers.restart_in_pieces, root, dirs, NODES, rows, PIECE, True)
    assert [r[:2] for r in results] == [(3, "memory"), (3, "peer")]  # values checked bitwise
    a, b = (_step3(r[2]) for r in results)
    assert len(a) == 6 and b == a
    # node b's folder is whole again: the next restart reads memory only
    again = run_ranks(2, workers.restart_in_pieces, root, dirs, NODES, rows, PIECE, True)
    assert [r[:2] for r in again] == [(3, "memory"), (3, "memory")]


@pytest.mark.parametrize("cols", [False, True], ids=["into-state", "into-files"])
def test_damaged_replica_fails_the_load_then_storage_serves(tmp_path: Path, cols: bool) -> None:
    root, dirs = _saved(tmp_path)
    shutil.rmtree(dirs[1])
    (kept,) = Path(dirs[0]).rglob("step-000000003/data-*-00001.bin")  # rank 1's, on node a
    raw = bytearray(kept.read_bytes())
    raw[PIECE + 10] ^= 0xFF  # in the second piece: found while the rest arrives
    kept.write_bytes(bytes(raw))
    rows = 2 * workers.ROWS
    results = run_ranks(2, workers.restart_in_pieces, root, dirs, NODES, rows, PIECE, cols)
    assert [r[:2] for r in results] == [(2, "storage"), (2, "storage")]


def test_arrivals_wake_readers_and_report_a_failed_transfer(tmp_path: Path) -> None:
    path, other = tmp_path / "data-ab-00001.bin", tmp_path / "data-ab-00000.bin"
    arrivals = Arrivals({path: 10})
    arrivals.wait(other, 10**9)  # not being received: never waited for
    done: list[int] = []
    reader = threading.Thread(target=lambda: (arrivals.wait(path, 8), done.append(8)))
    reader.start()
    arrivals.arrived(path, 4)
    reader.join(0.2)
    assert done == []  # bytes [4, 8) are not there yet
    arrivals.arrived(path, 8)
    reader.join(10)
    assert done == [8]
    arrivals.fail(RuntimeError("peer gone"))
    arrivals.wait(path, 8)  # already there
    with pytest.raises(DistributedCheckpointError) as e:
        arrivals.wait(path, 10)
    assert str(e.value) == f"{path} stopped arriving after 8 of 10 bytes: peer gone"
