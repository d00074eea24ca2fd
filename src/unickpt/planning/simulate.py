"""Planning at scale without processes: an FSDP x TP job of many ranks, simulated.

Every rank's packed local plan is built as that rank would (TP splits the columns of each
matrix, FSDP splits its rows; optionally in replica groups, HSDP), then the global plan and the
metadata are built exactly as a save does (the chunk map included), for the first save and for
a later one of the same plan. Reports the time of each step, what a rank exchanges and the
metadata size; the restore side is :mod:`unickpt.bench.restore_plan` (it reads files, which
planning does not).

>>> simulate_save(ranks=64, tensors=20).report["chunks"]
1280
"""

from __future__ import annotations

import json
import pickle
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.chunk_map import ChunkMap
from ..format.codec import encode_index, encode_metadata
from ..format.metadata import ChunkMeta, FileRef, Metadata, TensorMeta
from .packed import (
    PackedPlan,
    encode_rest,
    first_holders,
    pack_single,
    shared_parts,
    without_shared,
)
from .save_plan import GlobalPlan, build_global_plan, rank_loads


def split(n: np.ndarray, parts: int, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths of part ``i`` of each ``n`` split like torch.chunk (uneven last)."""
    step = -(-n // parts)
    lo = np.minimum(n, i * step)
    return lo, np.minimum(n, lo + step) - lo


def _local_plan(
    rank: int, ranks: int, tp: int, table: bytes, shapes: np.ndarray, replicas: int = 1
) -> PackedPlan:
    """What ``rank`` sends, packed as a real rank packs it: one box per tensor it holds
    (``replicas`` groups of FSDP x TP ranks holding the same boxes: HSDP)."""
    group = ranks // replicas
    dp = group // tp
    d, t = divmod(rank % group, tp)
    r0, rn = split(shapes[:, 0], dp, d)
    c0, cn = split(shapes[:, 1], tp, t)
    held = (rn > 0) & (cn > 0)
    coords = np.stack([r0, c0, rn, cn], axis=1)[held]
    return pack_single(table, held, coords, encode_rest((), (), {}))


@dataclass(frozen=True)
class SimulatedSave:
    """A simulated first save: its figures, the global plan, the metadata (index files of the
    ``indexes`` ranks encoded; the other ranks' index sizes and checksums are stand-ins)."""

    report: dict[str, Any]
    plan: GlobalPlan
    meta: Metadata
    indexes: dict[int, bytes]


def simulate_save(
    ranks: int = 4096,
    tensors: int = 2000,
    tp: int = 8,
    replicas: int = 1,
    share_bytes: int = 16 << 20,
) -> SimulatedSave:
    """Plan a save of ``tensors`` matrices on ``ranks`` ranks (FSDP x TP ``tp``, in
    ``replicas`` replica groups), boxes of several holders cut in shares of ``share_bytes``."""
    shapes = np.array([(4096 + 512 * (i % 3), 4096) for i in range(tensors)], dtype=np.int64)
    table = json.dumps(
        [
            [f"model.layers.{i // 8}.w{i % 8}", "bfloat16", s, "dtensor"]
            for i, s in enumerate(shapes.tolist())
        ]
    ).encode()
    clock = _Clock()
    plans = [_local_plan(r, ranks, tp, table, shapes, replicas) for r in range(ranks)]
    local_s = clock.lap()
    plans[0].signature()
    signature_s = clock.lap()
    sent = max(len(pickle.dumps(without_shared(p))) for p in plans)
    owners = first_holders([(p.table_id, p.kinds_id) for p in plans])
    shared = sum(len(pickle.dumps(shared_parts(plans[r], owners, r))) for r in set(owners.values()))
    clock.lap()
    plan = build_global_plan(plans, share_bytes)
    plan_s, plan_cpu_s = clock.lap(), clock.cpu()
    del plans
    plan.group_by_rank()
    sample = sorted({round(i * (ranks - 1) / max(1, _SAMPLE - 1)) for i in range(_SAMPLE)})
    indexes: dict[int, bytes] = {}
    clock.lap()
    for rank in sample:
        indexes[rank] = encode_rank_index(plan, rank)
    index_s = clock.lap() / len(sample)
    loads = rank_loads(plan)
    clock.lap()
    chunk_map = plan.chunk_map(np.arange(ranks))
    meta = _metadata(plan, loads, indexes, chunk_map)
    raw = encode_metadata(meta)
    first_s, first_cpu_s = clock.lap(), clock.cpu()
    raw = encode_metadata(_metadata(plan, loads, indexes, chunk_map))  # a later save's
    metadata_s, metadata_cpu_s = clock.lap(), clock.cpu()
    index_sizes = [len(b) for b in indexes.values()]
    report: dict[str, Any] = {
        "ranks": ranks,
        "tensors": tensors,
        "replicas": replicas,
        "chunks": plan.chunks,
        "local_plans_all_ranks_s": round(local_s, 3),
        "first_save_exchange_bytes_per_rank": sent,
        "first_save_shared_tables_bytes": shared,
        "first_save_received_bytes_per_rank": ranks * sent + shared,
        "first_save_global_plan_s": round(plan_s, 3),
        "first_save_global_plan_cpu_s": round(plan_cpu_s, 3),
        "first_save_coordinator_metadata_s": round(first_s, 4),
        "first_save_coordinator_metadata_cpu_s": round(first_cpu_s, 4),
        "cached_save_exchange_bytes_per_rank": _CACHED_CHECK_BYTES,
        "cached_save_signature_s": round(signature_s, 4),
        "per_save_rank_index_encode_s": round(index_s, 4),
        "per_save_coordinator_metadata_s": round(metadata_s, 4),
        "per_save_coordinator_metadata_cpu_s": round(metadata_cpu_s, 4),
        "global_metadata_bytes": len(raw),
        "index_bytes_per_rank_max": max(index_sizes),
        "index_bytes_total_est": round(sum(index_sizes) * ranks / len(index_sizes)),
    }
    return SimulatedSave(report, plan, meta, indexes)


_CACHED_CHECK_BYTES = 5 * 8
"""What a rank sends to learn that every rank's structure is the cached plan's: five int64 in
one all-reduce (then the coordinator broadcasts the save's id)."""


def _metadata(
    plan: GlobalPlan, loads: list[int], indexes: dict[int, bytes], chunk_map: ChunkMap
) -> Metadata:
    """The coordinator's metadata of a save of ``plan`` (index sizes and checksums of the
    ranks whose indexes were not encoded are stand-ins)."""
    refs = [
        FileRef(f"data-0-{r:05d}.bin", nbytes, "i", len(indexes.get(r, b"")), "0")
        for r, nbytes in enumerate(loads)
    ]
    return Metadata(
        world_size=plan.world_size,
        files=tuple(r.data for r in refs),
        tensors={k: TensorMeta(d, s, lay, ()) for k, (d, s, lay) in plan.tensors.items()},
        objects={},
        per_rank={},
        segment_bytes=1 << 20,
        file_refs=tuple(refs),
        chunk_map=chunk_map,
    )


_SAMPLE = 16
"""Ranks whose index files are encoded (and decoded): every file costs the same."""


class _Clock:
    """Wall and CPU seconds of this process since the last lap."""

    def __init__(self) -> None:
        self.wall, self.proc, self.last_cpu = time.perf_counter(), time.process_time(), 0.0

    def lap(self) -> float:
        wall, proc = time.perf_counter(), time.process_time()
        took, self.last_cpu = wall - self.wall, proc - self.proc
        self.wall, self.proc = wall, proc
        return took

    def cpu(self) -> float:
        """CPU seconds of the last lap."""
        return self.last_cpu


def encode_rank_index(plan: GlobalPlan, rank: int) -> bytes:
    entries = [
        (i.key, ChunkMeta(i.box.offsets, i.box.lengths, 0, i.byte_offset, i.nbytes, _sums(i)))
        for i in plan.writes(rank)
    ]
    return encode_index(f"data-0-{rank:05d}.bin", entries)


def _sums(item: Any) -> tuple[str, ...]:
    return ("0123456789abcdef",) * max(1, -(-item.nbytes // (1 << 20)))
