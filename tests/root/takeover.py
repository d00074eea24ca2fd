"""A Checkpointer whose root's lock another writer takes (local files and S3): rank functions
and the check of their outcome, shared by the tests of both backends."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import unickpt
from unickpt.config import get_config
from unickpt.storage import LocalStorage


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((4096,), float(step))}


_OTHER_WRITER: list[Any] = []  # the lock another writer took, held while the ranks save


def take_the_lock(root: str) -> None:
    """Another writer takes the root's lock from under its holder: on local files, the LOCK
    file was deleted and the other writer locks the new one; on S3, the lock object names a
    writer on another host (as a takeover writes it)."""
    if root.startswith("s3://"):
        from tests.storage.s3_server import raw_client

        bucket, prefix = root[len("s3://") :].split("/", 1)
        other = {"holder": "pid 4242 on node-9", "host": "node-9", "pid": 4242,
                 "run_id": "SLURM_JOB_ID=7781", "since": "2026-01-01T00:00:00+00:00",
                 "token": "not-yours"}  # fmt: skip
        body = json.dumps(other).encode()
        client = raw_client(os.environ["AWS_ENDPOINT_URL"])
        client.put_object(Bucket=bucket, Key=f"{prefix}/LOCK", Body=body)
        return
    os.unlink(Path(root) / "LOCK")
    _OTHER_WRITER.append(LocalStorage(root).acquire_lock())


def saves_after_the_lock_is_taken(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save, let another writer take the lock, save again: the second save must raise on
    every rank, before anything is written or deleted."""
    config = get_config(collective_timeout_s=60)
    ckpt = unickpt.Checkpointer(root, keep_last=1, config=config)
    ckpt.save(1, _state(1)).wait()
    if rank == 0:
        take_the_lock(root)
    dist.barrier()
    outcomes = []
    for step in (2, 3):
        try:
            ckpt.save(step, _state(step)).wait()
            outcomes.append("saved")
        except unickpt.CheckpointLockedError as e:
            outcomes.append(str(e))
    ckpt.close()
    dist.barrier()
    return {"outcomes": outcomes, "steps": unickpt.Checkpointer(root).steps()}


def check_the_lock_was_taken(results: list[dict[str, Any]], root: str, taken: str) -> None:
    """Both saves after the takeover raised the coordinator's check on every rank (``taken``:
    a pattern of what it found), and nothing was saved or deleted."""
    for rank, result in enumerate(results):
        assert result["steps"] == [1], rank
        first, second = result["outcomes"]
        assert first == second == results[0]["outcomes"][0], rank
        assert re.fullmatch(
            f"checking the lock of {re.escape(root)} failed on 1 of 2 ranks:\n  rank 0: "
            f"CheckpointLockedError: {taken}\\. Another job may be saving into the same "
            "place, and this one stops saving there rather than write beside it \\(or let its "
            "retention delete the other's checkpoints\\)\\. Stop one of the jobs, or give it "
            "another path, and restart it\\.",
            first,
        ), first
