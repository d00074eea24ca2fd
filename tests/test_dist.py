"""unickpt's own process groups: made anew after ``destroy_process_group()``, released at exit.

Real gloo processes. A job that tears its process group down and starts a new one (a second
``init_process_group`` in the same processes) saves and loads again; the groups unickpt made
are destroyed by ``release_groups`` (run at interpreter exit), after which a Comm that still
holds one says so instead of acting as a single process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import unickpt
from tests.distributed import _free_port, run_ranks, shared_dir
from unickpt import dist as udist
from unickpt.errors import DistributedCheckpointError


def _state(rank: int, value: float) -> dict[str, Any]:
    local = torch.arange(4, dtype=torch.float32) + 10 * rank + value
    return {"w": unickpt.ShardedTensor(local, (8,), (4 * rank,))}


def _roundtrip(path: str, rank: int, value: float) -> bool:
    unickpt.save(path, _state(rank, value))
    dest = _state(rank, -100.0)
    unickpt.load(path, dest)
    return torch.equal(dest["w"].local, _state(rank, value)["w"].local)


def _groups_across_inits(rank: int, world: int, root: str, port: int) -> dict[str, Any]:
    out: dict[str, Any] = {"first": _roundtrip(f"{root}/a", rank, 1.0)}
    first = udist.Comm()
    assert first._group is not None and first._group.alive
    dist.destroy_process_group()  # the job tears its group down...
    out["stale_after_destroy"] = not first._group.alive
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)  # ...and starts a new one
    out["second"] = _roundtrip(f"{root}/b", rank, 2.0)
    try:
        first.barrier()  # a Comm (as a Checkpointer keeps one) made before the new init
        out["stale_use"] = "no error"
    except DistributedCheckpointError as e:
        out["stale_use"] = str(e)
    second = udist.Comm()
    out["new_group"] = second._group is not first._group and second._group is not None
    udist.release_groups()  # what interpreter exit runs
    out["released"] = second._group is not None and not second._group.alive
    try:
        second.barrier()
        out["after_release"] = "no error"
    except DistributedCheckpointError as e:
        out["after_release"] = str(e)
    out["third"] = _roundtrip(f"{root}/c", rank, 3.0)  # new groups again
    return out


def test_groups_are_made_anew_after_destroy_and_released_at_exit(tmp_path: Path) -> None:
    root = shared_dir(tmp_path, "ckpts")
    results = run_ranks(2, _groups_across_inits, root, _free_port())
    for r in results:
        assert r["first"] and r["second"] and r["third"]
        assert r["stale_after_destroy"] and r["new_group"] and r["released"]
        assert "unickpt's process groups were released" in r["after_release"]
        assert "before the interpreter exits" in r["after_release"]
        assert "destroyed by torch.distributed.destroy_process_group()" in r["stale_use"]
        assert "make a new Checkpointer" in r["stale_use"]


_EXITING = """
import unickpt.dist as d

class Group:
    def release(self):
        print("released at exit", flush=True)

d._OWNED.append(Group())
print("exiting", flush=True)
"""


def test_interpreter_exit_releases_every_group() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _EXITING], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["exiting", "released at exit"]
