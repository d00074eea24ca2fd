"""Reads shared across nodes: four gloo ranks as one to four nodes (``UNICKPT_NODE``) load the
same bytes; each byte is fetched once, reaches the others over the process group, is checked
by every rank that uses it, and a rank that fails to fetch fails the load on every rank."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.tensor import Shard, distribute_tensor

import unickpt
from tests.api.layouts_zoo import mesh
from tests.distributed import run_ranks
from unickpt.config import get_config
from unickpt.storage import LocalStorage

SEG = 4096
WORLD = 4
# Small units and rounds: whole chunks and pieces of chunks, several rounds.
SMALL = get_config(segment_bytes=SEG, window_bytes=16 * SEG, read_piece_bytes=32 * SEG)
OFF = get_config(segment_bytes=SEG, share_across_nodes=False)


def _tensors() -> dict[str, torch.Tensor]:
    """Sizes in multiples of 64 bytes (no padding between chunks): every byte read is needed."""
    g = torch.Generator().manual_seed(11)
    return {
        "emb": torch.randn(512, 96, generator=g),  # 192 KiB: units of 16 KiB
        "w": torch.randn(96, 96, generator=g).to(torch.bfloat16),
        "norm": torch.randn(16, generator=g),
        "bias": torch.randn(32, generator=g),
        "steps": torch.arange(8, dtype=torch.int64),
    }


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _nodes(names: str) -> None:
    """This rank's node: the ``rank``-th letter of ``names`` ("abcd": four nodes)."""
    os.environ["UNICKPT_NODE"] = f"node-{names[dist.get_rank()]}"


def _plain(path: str, config: Any) -> tuple[bool, int, int, int]:
    """Load the replicated tensors: (values equal, bytes read, received, placed)."""
    dest = {k: torch.zeros_like(v) for k, v in _tensors().items()}
    report = unickpt.load(path, dest, config=config)
    equal = all(torch.equal(dest[k], v) for k, v in _tensors().items())
    return equal, report.bytes_read, report.bytes_received, report.bytes_wanted


def _sharded(dim: int, fill: bool) -> dict[str, Any]:
    return {
        k: distribute_tensor(v if fill else torch.zeros_like(v), mesh((WORLD,)), [Shard(dim)])
        for k, v in _tensors().items()
        if v.dim() == 2
    }


def _resharded(path: str, config: Any) -> tuple[bool, int, int, int]:
    """Load the Shard(0) save as Shard(1): each rank needs a column slice of every chunk."""
    dest = _sharded(1, fill=False)
    report = unickpt.load(path, dest, config=config)
    want = _sharded(1, fill=True)
    equal = all(torch.equal(dest[k].to_local(), want[k].to_local()) for k in want)
    return equal, report.bytes_read, report.bytes_from_peers, report.bytes_received


class _Unreadable(LocalStorage):
    """A local checkpoint whose data files this rank cannot read (an I/O error), as a node
    whose mount of the storage fails would see it."""

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        if name.startswith("data-"):
            raise OSError(errno.EIO, "Input/output error", f"{self.location}/{name}")
        super().read_into(name, offset, out)


def _failing_fetch(path: str, failing: int) -> tuple[str, str] | tuple[bool, int]:
    """Rank ``failing`` cannot read the data files; the others can. One small tensor: one
    fetch, which rank 0 reads (all nodes equally loaded: the first)."""
    storage = _Unreadable(path) if dist.get_rank() == failing else LocalStorage(path)
    dest = {"bias": torch.zeros(32)}
    try:
        report = unickpt.load(storage, dest, config=SMALL)
    except unickpt.CheckpointError as e:
        return type(e).__name__, str(e)
    return torch.equal(dest["bias"], _tensors()["bias"]), report.bytes_read


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _memory_fallback(root: str, shm: str, config: Any) -> tuple[bool, int]:
    """A Checkpointer with a memory tier that holds nothing loads from storage: (values equal,
    bytes this rank read by read calls during the load)."""
    tier = unickpt.MemoryTier(
        persist_every=100, dir=f"{shm}/{dist.get_rank()}-{config.share_across_nodes}"
    )
    ckpt = unickpt.Checkpointer(root, memory=tier, config=config)
    dest = {k: torch.zeros_like(v) for k, v in _tensors().items()}
    before = _rchar()
    step = ckpt.load_latest(dest)
    read = _rchar() - before
    ckpt.close()
    assert ckpt.last_restore is not None and ckpt.last_restore.source == "storage"
    equal = step == 1 and all(torch.equal(dest[k], v) for k, v in _tensors().items())
    return equal, read


def _loads(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain, sharded = f"{root}/plain", f"{root}/sharded"
    unickpt.save(plain, _tensors(), config=SMALL)  # replicated: each tensor written once
    unickpt.save(sharded, _sharded(0, fill=True), config=SMALL)
    unickpt.save(f"{root}/packed", _tensors(), config=SMALL, compress=True)
    if rank == 0:
        save_file(_tensors(), f"{root}/model.safetensors")
    dcp.save({"model": _tensors()}, checkpoint_id=f"{root}/dcp")
    dist.barrier()
    _nodes("abcd")
    out["on"] = _plain(plain, SMALL)
    # Ranks configured apart (another read_piece_bytes on rank 0) still plan alike.
    out["apart"] = _plain(plain, get_config(segment_bytes=SEG) if rank == 0 else SMALL)
    out["default"] = _plain(plain, get_config())
    out["off"] = _plain(plain, OFF)
    out["reshard"] = _resharded(sharded, SMALL)
    out["compressed"] = _plain(f"{root}/packed", SMALL)
    out["safetensors"] = _plain(f"{root}/model.safetensors", SMALL)
    dcp_dest = {"model": {k: torch.zeros_like(v) for k, v in _tensors().items()}}
    report = unickpt.load(f"{root}/dcp", dcp_dest, config=SMALL)
    equal = all(torch.equal(dcp_dest["model"][k], v) for k, v in _tensors().items())
    out["dcp"] = (equal, report.bytes_read, report.bytes_received)
    out["fails at the reader"] = _failing_fetch(plain, failing=0)
    out["fails at a receiver"] = _failing_fetch(plain, failing=3)
    # Two nodes of two ranks: same layout and resharded, through the page cache (local files)
    # and through /dev/shm (fsspec's local file system) inside a node.
    _nodes("aabb")
    out["2x2"] = _plain(plain, SMALL)
    out["2x2 reshard"] = _resharded(sharded, SMALL)
    out["2x2 reshard fsspec"] = _resharded(f"file://{sharded}", SMALL)
    # Two nodes named apart on one machine never share /dev/shm buffers: without reads across
    # nodes, each node reads every chunk once (with one node name, the host reads it once).
    out["2x2 reshard fsspec off"] = _resharded(f"file://{sharded}", OFF)
    _nodes("aaaa")
    out["one node fsspec"] = _resharded(f"file://{sharded}", SMALL)
    out["one node"] = _plain(plain, SMALL)
    # The memory tier's fallback to storage reads once across nodes too.
    _nodes("abcd")
    ckpt = unickpt.Checkpointer(f"{root}/ckpt", async_save=False, config=SMALL)
    ckpt.save(1, _tensors())
    ckpt.close()
    out["memory fallback"] = _memory_fallback(f"{root}/ckpt", f"{root}/shm", SMALL)
    out["memory fallback off"] = _memory_fallback(f"{root}/ckpt", f"{root}/shm", OFF)
    # Damage (in every node's view): the rank that fetches it finds it, before sending it.
    dist.barrier()
    if rank == 0:
        data = sorted(Path(plain).glob("data-*.bin"))
        with open(data[0], "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    try:
        _plain(plain, SMALL)
        out["damaged"] = None
    except unickpt.CheckpointError as e:
        out["damaged"] = (type(e).__name__, str(e))
    return out


def test_ranks_of_several_nodes_fetch_each_byte_once(tmp_path: Path) -> None:
    results = run_ranks(WORLD, _loads, str(tmp_path))
    total = _nbytes(_tensors())
    sharded = _nbytes({k: v for k, v in _tensors().items() if v.dim() == 2})

    def column(name: str, i: int) -> list[Any]:
        return [r[name][i] for r in results]

    for name in ("on", "apart", "default", "compressed", "safetensors", "2x2", "one node"):
        assert all(column(name, 0)), f"{name}: values differ"
        assert column(name, 3) == [total] * WORLD, name
    # Four nodes: every byte read once, by one rank, and received by the three others.
    for name in ("on", "apart", "default", "safetensors", "2x2"):
        assert sum(column(name, 1)) == total, name
        assert sum(column(name, 2)) == 3 * total, name
    assert all(0 < n < total for n in column("on", 1)), "the reads spread over the nodes"
    # Compressed: the stored bytes once (fewer than the raw ones).
    assert 0 < sum(column("compressed", 1)) < total
    assert sum(column("compressed", 2)) > 0
    assert [r["dcp"][0] for r in results] == [True] * WORLD
    assert sum(r["dcp"][1] for r in results) == total
    # The option off reads as before: each node every byte; one node alone reads as before.
    assert column("off", 1) == [total] * WORLD and column("off", 2) == [0] * WORLD
    assert column("one node", 1) == [total] * WORLD and column("one node", 2) == [0] * WORLD
    # Resharded, Shard(0) saved and Shard(1) loaded: every saved byte read once.
    for name in ("reshard", "2x2 reshard", "2x2 reshard fsspec"):
        assert all(column(name, 0)), f"{name}: values differ"
        assert sum(column(name, 1)) == sharded, name
        assert sum(column(name, 3)) == 3 * sharded, name
    # Without reads across nodes, the ranks of each node share through /dev/shm only: each
    # node reads every chunk once; the host reads it once when the four ranks are one node.
    assert all(column("2x2 reshard fsspec off", 0))
    assert sum(column("2x2 reshard fsspec off", 1)) == 2 * sharded
    assert all(n > 0 for n in column("2x2 reshard fsspec off", 2))
    assert column("2x2 reshard fsspec off", 3) == [0] * WORLD
    assert sum(column("one node fsspec", 1)) == sharded
    assert column("one node fsspec", 3) == [0] * WORLD
    # A rank that fails to fetch fails the load on every rank, with its error; a rank that
    # could not have read the bytes itself gets them from the one that read them.
    errors = [r["fails at the reader"] for r in results]
    assert all(e == errors[0] for e in errors), errors
    kind, message = errors[0]
    assert "loading failed on 1 of 4 ranks" in message and "rank 0: OSError" in message
    assert "Input/output error" in message
    assert [r["fails at a receiver"] for r in results] == [(True, 128)] + [(True, 0)] * 3
    # The memory tier's fallback to storage: one rank reads the data, the others receive it.
    assert all(r["memory fallback"][0] and r["memory fallback off"][0] for r in results)
    assert sum(r["memory fallback"][1] for r in results) < total + total // 2
    assert all(r["memory fallback off"][1] >= total for r in results)
    # Damage found by the rank that fetched it fails the load on every rank.
    damaged = [r["damaged"] for r in results]
    assert damaged[0] is not None and all(d == damaged[0] for d in damaged)
    kind, message = damaged[0]
    assert kind == "CheckpointCorruptError"
    assert "loading failed on 1 of 4 ranks" in message and "checksum mismatch in data-" in message
