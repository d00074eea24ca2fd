"""A failure on one rank of the memory tier, in a step that rank takes alone before a collective,
fails the save or restore on every rank at once, with that rank's error; none waits for the
collective timeout, and the next save goes on. Real gloo ranks on two "nodes" (folders of
their own), the failure injected on one rank (:mod:`tests.tiers.faults`), a collective timeout
of 20 s so that a rank left waiting fails the test instead of hanging it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tests.distributed import run_ranks, start_ranks
from tests.tiers import faults, workers
from tests.tiers.test_restart import _kill

# (fault, the step that fails, the failing rank, its error's kind, the start of its message)
SAVES = [
    ("commit read", "reading the commit of memory step 2", 0, "CheckpointError", "injected"),
    (
        "memory folder",
        "preparing the memory folders for step 4",
        1,
        "CheckpointError",
        "preparing the memory folder .* failed: File exists",
    ),
    (
        "commit copy",
        "copying the commit of memory step 6 to every node",
        1,
        "CheckpointError",
        "writing the commit of memory step 6 into .* failed: injected failure",
    ),
    (
        "replica room",
        "making room for the replicas of memory step 8",
        1,
        "CheckpointError",
        "making room for replicas in .* failed: injected failure",
    ),
    (
        "replica send",
        "sending the replicas of memory step 10",
        0,
        "CheckpointCorruptError",
        r"rank 0: the memory tier could not use 1 file\(s\) it moves: .*-00000\.bin \(\[Errno 2\]",
    ),
    (
        "replica rename",
        "committing the replicas of memory step 12",
        1,
        "CheckpointError",
        "renaming the replicas' indexes into place in .* failed: injected failure",
    ),
]


def test_a_memory_save_failing_on_one_rank_fails_on_every_rank_and_the_next_goes_on(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "store")
    dirs = {0: str(tmp_path / "node-a"), 1: str(tmp_path / "node-b")}
    nodes = {0: "a", 1: "b"}
    fault_names = [f for f, *_ in SAVES]
    results = run_ranks(
        2, faults.saves_with_one_rank_failing, root, dirs, nodes, fault_names, timeout_s=300
    )
    assert results[0] == results[1]
    outcomes = results[0]["outcomes"]
    assert len(outcomes) == 1 + 2 * len(SAVES)
    assert outcomes[0::2] == ["saved"] * (1 + len(SAVES))  # every save after a failure goes on
    for (fault, what, rank, kind, start), got in zip(SAVES, outcomes[1::2], strict=True):
        expected = f"{re.escape(what)} failed on 1 of 2 ranks:\n  rank {rank}: {kind}: {start}"
        assert re.match(expected, got), (fault, got)
    assert results[0]["newest"] == 1 + 2 * len(SAVES)


def test_a_restore_failing_on_one_rank_fails_or_falls_back_on_every_rank(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    a, b = str(tmp_path / "node-a"), str(tmp_path / "node-b")
    nodes = {0: "a", 1: "a", 2: "b", 3: "b"}
    dirs = {0: a, 1: a, 2: b, 3: b}
    procs, _ = start_ranks(4, workers.save_steps, root, dirs, nodes, [1, 2, 3], 2)
    _kill(procs)
    cases = [
        # resharded: node b's first rank receives whole files into its folder for both ranks
        ("room", True, "planning the restore from memory", "making room for the files of"),
        ("index", True, "receiving the files of memory step 3", "writing index-"),
    ]
    for fault, cols, what, start in cases:
        shutil.rmtree(b, ignore_errors=True)  # node b is lost with its memory
        results = run_ranks(
            4, faults.restores_with_one_rank_failing, root, dirs, nodes, cols, fault, timeout_s=300
        )
        assert results[0][0] == "error" and results == [results[0]] * 4, (fault, results)
        assert results[0][1].startswith(f"{what} failed on 1 of 4 ranks:\n  rank 2: "), results
        assert start in results[0][1] and "injected failure" in results[0][1], results
    # the same layout: chunks sent straight into the receivers' state while they load; the
    # sender cannot open its file: every rank falls back to storage together
    shutil.rmtree(b, ignore_errors=True)
    results = run_ranks(
        4, faults.restores_with_one_rank_failing, root, dirs, nodes, False, "send", timeout_s=300
    )
    assert results == [(2, "storage")] * 4
