"""The bytes a resharded load from S3 reads against the bytes it needs, on new rank processes.

``world`` processes on this host, joined over gloo, load the benchmark's checkpoint (one chunk
per matrix) as row blocks, then as column blocks (each rank needs a column slice of every
row). Every rank counts the bytes its ranged GETs fetched (the backend's own count) and the
bytes of its blocks; every block is checked against the saved values.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import Config
from ..storage.s3 import S3Storage
from . import ranks
from .s3_dcp import matrices


@dataclass(frozen=True)
class ReshardBytes:
    """Bytes fetched from S3 and bytes needed, summed over ranks, for one layout."""

    layout: str
    bytes_read: int
    bytes_needed: int
    bytes_from_peers: int

    @property
    def ratio(self) -> float:
        return self.bytes_read / self.bytes_needed


def measure_reshard(
    url: str, tensors: int, world: int, config: Config, timeout_s: float = 600.0
) -> list[ReshardBytes]:
    """Load ``url`` (the ``tensors`` matrices of :func:`~unickpt.bench.s3_dcp.matrices`)
    on ``world`` new rank processes (:mod:`unickpt.bench.ranks`) as row blocks and column
    blocks; their byte counts."""
    ctx = ranks.context()
    queue = ctx.Queue()
    args = (world, ranks.free_port(), url, tensors, config, queue)
    procs = [ranks.start(ctx, _rank, r, *args) for r in range(world)]
    try:
        results = [queue.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = [r for ok, r in results if not ok]
    if failed:
        raise RuntimeError(f"a rank of the resharded load failed:\n{failed[0]}")
    per_rank = [r for _, r in results]
    return [
        ReshardBytes(
            layout,
            sum(r[layout][0] for r in per_rank),
            sum(r[layout][1] for r in per_rank),
            sum(r[layout][2] for r in per_rank),
        )
        for layout in ("row", "column")
    ]


def _rank(
    rank: int, world: int, port: int, url: str, tensors: int, config: Config, queue: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out = {
            "row": _load_blocks(url, tensors, rank, world, 0, config),
            "column": _load_blocks(url, tensors, rank, world, 1, config),
        }
        queue.put((True, out))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        queue.put((False, f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _load_blocks(
    url: str, tensors: int, rank: int, world: int, dim: int, config: Config
) -> tuple[int, int, int]:
    """(bytes fetched, bytes needed, bytes from peers) of this rank's blocks along ``dim``."""
    import unickpt

    expected = _blocks(tensors, rank, world, dim)
    state = {
        k: unickpt.ShardedTensor(torch.zeros_like(block), shape, offsets)
        for k, (block, shape, offsets) in expected.items()
    }
    storage = S3Storage(url)
    report = unickpt.load(storage, state, config=config)
    wrong = [k for k, (block, _, _) in expected.items() if not torch.equal(state[k].local, block)]
    if wrong:
        raise RuntimeError(f"resharded load along dim {dim}: {wrong} differ from what was saved")
    if report.bytes_read != storage.stats.bytes_read:
        raise RuntimeError(
            f"the load reports {report.bytes_read} bytes read, the backend fetched "
            f"{storage.stats.bytes_read}"
        )
    needed = sum(b.numel() * b.element_size() for b, _, _ in expected.values())
    return storage.stats.bytes_read, needed, report.bytes_from_peers


def _blocks(
    tensors: int, rank: int, world: int, dim: int
) -> dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """This rank's block of every matrix along ``dim``: (values, global shape, offsets); one
    whole matrix in memory at a time."""
    out: dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]] = {}
    for k, t in matrices(tensors * 64):
        n = t.shape[dim]
        lo, hi = n * rank // world, n * (rank + 1) // world
        offsets = (lo, 0) if dim == 0 else (0, lo)
        out[k] = (t.narrow(dim, lo, hi - lo).clone(), tuple(t.shape), offsets)
    return out
