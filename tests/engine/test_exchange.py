"""Resharded loads through the exchange: values, exact bytes read, damage found by the reader."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

import unickpt
from tests.api.layouts_zoo import mesh
from tests.distributed import run_ranks
from unickpt.config import get_config
from unickpt.dist import Comm
from unickpt.engine import exchange
from unickpt.engine.commit import read_checkpoint
from unickpt.engine.exchange import rank_needs, run_exchange
from unickpt.engine.mapped import run_mapped_exchange
from unickpt.engine.read_chunks import execute_reads
from unickpt.layouts.boxes import Box
from unickpt.planning.exchange_plan import ExchangePlan, RankNeeds, plan_exchange
from unickpt.planning.load_plan import ReadItem, plan_reads
from unickpt.storage import LocalStorage

SEG = 4096


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a": torch.randn(256, 96, generator=g),  # chunks of 48 KiB: 12 segments, 12 units
        "b": torch.randn(33, 40, generator=g).to(torch.bfloat16),  # rows split 17 / 16
        "c": torch.randint(-1000, 1000, (10, 12), generator=g, dtype=torch.int64),
        "d": torch.randn(8, 24, 40, generator=g),  # 3-D: rows of 20 of 40 elements
        "e": torch.randn(12, 768, generator=g),  # half rows of 1.5 KiB: copied overlapping
    }


def _state(dim: int, world: int, fill: bool) -> dict[str, Any]:
    return {
        k: distribute_tensor(t if fill else torch.zeros_like(t), mesh((world,)), [Shard(dim)])
        for k, t in _tensors().items()
    }


def _equal(state: dict[str, Any], world: int) -> bool:
    want = _state(1, world, fill=True)
    return all(torch.equal(state[k].to_local(), want[k].to_local()) for k in want)


def _buffers() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("unickpt-load-")}


def _loads(rank: int, world: int, root: str) -> dict[str, Any]:
    path = f"{root}/c"
    before = _buffers()  # other jobs' loads on this machine are none of this test's business
    unickpt.save(path, _state(0, world, fill=True), config=get_config(segment_bytes=SEG))
    small = get_config(segment_bytes=SEG, window_bytes=16 * SEG, read_piece_bytes=16 * SEG)
    out: dict[str, Any] = {}
    # Local files share through the page cache (mapped units); a backend that cannot map
    # (here fsspec's local file system) through buffers in /dev/shm, with units of one
    # segment and rounds of 4 units: many rounds through both buffers.
    for prefix, url in (("", path), ("fsspec ", f"file://{path}")):
        for name, config in (
            ("shared", small),
            ("default", get_config()),
            ("alone", get_config(share_reads=False)),
        ):
            dest = _state(1, world, fill=False)
            report = unickpt.load(url, dest, config=config)
            out[prefix + name] = (_equal(dest, world), report.bytes_read, report.bytes_wanted)
            out[prefix + name + " from peers"] = report.bytes_from_peers
    out["unmapped"] = _unmapped(path, world, small)
    dest = _state(0, world, fill=False)
    out["same layout"] = unickpt.load(path, dest, config=small).bytes_from_peers
    dist.barrier()
    if rank == 0:  # damage one byte of the second data file
        data = sorted(Path(path).glob("data-*.bin"))[1]
        with open(data, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    for prefix, url in (("", path), ("fsspec ", f"file://{path}")):
        try:
            unickpt.load(url, _state(1, world, fill=False), config=small)
            out[prefix + "damaged"] = None
        except unickpt.CheckpointError as e:
            out[prefix + "damaged"] = (type(e).__name__, str(e))
    out["late damage"] = _late_damage(f"{root}/late", world, small)
    dist.barrier()  # every rank's load has returned (and removed its buffers)
    out["leftovers"] = sorted(_buffers() - before)
    out.update(_without_shared_memory(f"{root}/intact", world, small))
    return out


def _late_damage(path: str, world: int, config: Any) -> tuple[str, str, int, int] | None:
    """Damage in the last segment of a chunk: its owner has copied rows of earlier segments by
    then, and still fails the load on every rank. (error class, message, damaged byte, file)"""
    unickpt.save(path, _state(0, world, fill=True), config=config)
    _, meta = read_checkpoint(LocalStorage(path))
    chunk = meta.tensors["a"].chunks[0]
    name = meta.files[chunk.file]
    damaged = chunk.byte_offset + chunk.nbytes - 5
    dist.barrier()
    if dist.get_rank() == 0:
        with open(f"{path}/{name}", "r+b") as f:
            f.seek(damaged)
            byte = f.read(1)
            f.seek(damaged)
            f.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()
    try:
        unickpt.load(path, _state(1, world, fill=False), config=config)
    except unickpt.CheckpointError as e:
        return type(e).__name__, str(e), damaged, chunk.file
    return None


def _without_shared_memory(path: str, world: int, config: Any) -> dict[str, Any]:
    """No /dev/shm: the load reads alone; buffers refused mid-load: every rank reads alone."""
    unickpt.save(path, _state(0, world, fill=True), config=config)
    exchange.SHM_DIR = "/nonexistent-shm"
    try:
        dest = _state(1, world, fill=False)
        report = unickpt.load(path, dest, config=config)
        out: dict[str, Any] = {"no shm": (_equal(dest, world), report.bytes_read)}
        # Ranks grouped as one host, but creating the buffers fails on every owner.
        storage = LocalStorage(path)
        _, plan, _, needed = _one_host_plan(storage, world)
        stats = run_exchange(Comm(), storage, plan, needed, config, True, SEG)
        out["refused"] = (len(plan.units) > 0, stats)
    finally:
        exchange.SHM_DIR = "/dev/shm"
    return out


def _one_host_plan(
    storage: LocalStorage, world: int
) -> tuple[dict[str, Any], ExchangePlan, list[ReadItem], list[ReadItem]]:
    """A blank ``Shard(1)`` state, the exchange plan of its load with every rank in one host
    group, its read items and the items the exchange serves (same on every rank)."""
    _, meta = read_checkpoint(storage)
    dest = _state(1, world, fill=False)
    items = [
        i
        for k, t in dest.items()
        for i in plan_reads(k, meta.tensors[k], meta.files, [(_box(t), t.to_local())])
    ]
    needs, needed = rank_needs(storage, items, True, meta.segment_bytes, world)
    offers = [RankNeeds("host", n.token, n.needs) for n in _all_gather(needs)]
    plan = plan_exchange(offers, meta.tensors, meta.files, SEG, SEG, 4 * SEG)
    return dest, plan, items, needed


class _Unmappable(LocalStorage):
    """Local files whose ranges cannot be mapped (as on a file system without mmap)."""

    def map_range(self, name: str, offset: int, length: int) -> memoryview | None:
        return None


def _unmapped(path: str, world: int, config: Any) -> tuple[bool, int, int, int]:
    """A rank that cannot map a unit another rank owns reads the unit's bytes instead."""
    storage = _Unmappable(path)
    dest, plan, items, needed = _one_host_plan(storage, world)
    stats = run_mapped_exchange(dist.get_rank(), storage, plan, needed, config, True, SEG)
    done = plan.exchanged(dist.get_rank())
    rest = [item for i, item in enumerate(needed) if i not in done]
    execute_reads(storage, rest + [i for i in items if i not in needed], config, True, SEG)
    return _equal(dest, world), stats.bytes_read, stats.bytes_wanted, stats.bytes_from_peers


def _box(t: Any) -> Box:
    local = t.to_local()
    offsets = [0] * local.dim()
    offsets[1] = dist.get_rank() * t.shape[1] // dist.get_world_size()
    return Box(tuple(offsets), tuple(local.shape))


def _all_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def test_shard0_into_shard1_reads_every_byte_once_and_finds_damage(tmp_path: Path) -> None:
    results = run_ranks(2, _loads, str(tmp_path))
    total = sum(t.numel() * t.element_size() for t in _tensors().values())
    for prefix in ("", "fsspec "):
        for name in ("shared", "default", "alone"):
            assert all(r[prefix + name][0] for r in results), f"{prefix}{name}: values differ"
            assert sum(r[prefix + name][2] for r in results) == total
        # Read once: every saved byte by one rank; each rank got part of its share from the
        # other (through the page cache, or the owner's buffer in /dev/shm).
        assert sum(r[prefix + "shared"][1] for r in results) == total
        assert sum(r[prefix + "default"][1] for r in results) == total
        assert all(0 < r[prefix + "shared from peers"] < r[prefix + "shared"][2] for r in results)
        # Alone, each rank reads every chunk whole (it needs half of every row).
        assert sum(r[prefix + "alone"][1] for r in results) == 2 * total
        assert [r[prefix + "alone from peers"] for r in results] == [0, 0]
    # A unit that cannot be mapped is read by the other rank that needs part of it: right
    # values, every unit read twice here (by its owner, and by the other rank).
    unmapped = [r["unmapped"] for r in results]
    assert all(equal for equal, _, _, _ in unmapped)
    assert all(0 < peers < wanted for _, _, wanted, peers in unmapped)
    assert sum(read for _, read, _, _ in unmapped) == 2 * total
    assert [r["same layout"] for r in results] == [0, 0]
    # The damaged segment is read by one rank only; every rank raises that rank's error.
    for prefix in ("", "fsspec "):
        errors = [r[prefix + "damaged"] for r in results]
        assert errors[0] == errors[1] and errors[0] is not None
        kind, message = errors[0]
        assert kind == "CheckpointCorruptError"
        assert "loading failed on 1 of 2 ranks" in message and "checksum mismatch" in message
    # Damage in a chunk's last segment, found by the owner after copying earlier rows.
    late = [r["late damage"] for r in results]
    assert late[0] is not None and late[0] == late[1]
    kind, message, damaged, _ = late[0]
    assert kind == "CheckpointCorruptError"
    assert "loading failed on 1 of 2 ranks" in message
    found = re.search(
        r"checksum mismatch in (\S+) bytes \[(\d+), (\d+)\) holding tensor 'a'", message
    )
    assert found is not None, message
    assert found.group(1).startswith("data-") and "load an earlier checkpoint" in message
    assert int(found.group(2)) <= damaged < int(found.group(3))
    assert [r["leftovers"] for r in results] == [[], []]
    # Without shared memory every rank reads alone, with the same values.
    assert [r["no shm"] for r in results] == [(True, total), (True, total)]
    refused = [r["refused"] for r in results]
    assert all(has_units and stats is not None and not stats.shared for has_units, stats in refused)


class _Recording(LocalStorage):
    """A local checkpoint folder that records the names of the whole files read from it."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.names: list[str] = []

    def read_bytes(self, name: str) -> bytes | None:
        self.names.append(name)
        return super().read_bytes(name)


def _partial_needs(rank: int, world: int, root: str) -> dict[str, Any]:
    """Row halves saved by two ranks; rank 0 loads the left half of the top rows, rank 1 the
    right half of all rows. They share the top chunk; rank 0 needs nothing of the bottom."""
    g = torch.Generator().manual_seed(3)
    full = {k: torch.randn(64, 48, generator=g) for k in ("w", "v")}
    rows = slice(32 * rank, 32 * rank + 32)
    saved = {k: unickpt.ShardedTensor(t[rows].clone(), (64, 48), (32 * rank, 0))
             for k, t in full.items()}  # fmt: skip
    config = get_config(segment_bytes=SEG)
    unickpt.save(f"{root}/c", saved, config=config)
    box = ((0, 0), (32, 24)) if rank == 0 else ((0, 24), (64, 24))
    (r0, c0), (nr, nc) = box
    dest = {k: unickpt.ShardedTensor(torch.zeros(nr, nc), (64, 48), (r0, c0)) for k in full}
    storage = _Recording(f"{root}/c")
    report = unickpt.load(storage, dest, config=config)
    equal = all(torch.equal(dest[k].local, full[k][r0 : r0 + nr, c0 : c0 + nc]) for k in full)
    return {
        "equal": equal,
        "indexes": sorted({n.split("-")[-1] for n in storage.names if n.startswith("index-")}),
        "from peers": report.bytes_from_peers,
    }


def test_a_rank_reads_only_the_indexes_of_chunks_it_needs(tmp_path: Path) -> None:
    """The exchange plans chunks that only other ranks need from the geometry in their needs:
    no rank reads the index of a file it reads nothing from."""
    results = run_ranks(2, _partial_needs, str(tmp_path))
    assert all(r["equal"] for r in results)
    assert [r["indexes"] for r in results] == [["00000.json"], ["00000.json", "00001.json"]]
    assert all(r["from peers"] > 0 for r in results)  # the top chunk was read once, shared
