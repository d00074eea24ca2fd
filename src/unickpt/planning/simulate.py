"""Planning at scale without processes: an FSDP x TP job of many ranks, simulated.

Every rank's packed local plan is built as that rank would (TP splits the columns of each
matrix, FSDP splits its rows), then the global plan and the metadata are built exactly as a
save does; then a restore on as many ranks with another TP degree: one loading rank's cost of
reading the chunk indexes (from a sample of index files) and of planning its reads, as a load
does. Reports the time of each step and the metadata size.

>>> simulate_fsdp_tp(ranks=64, tensors=20)["chunks"]
1280
"""

from __future__ import annotations

import json
import math
import pickle
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..format.codec import assemble, decode_index, encode_index, encode_metadata
from ..format.metadata import ChunkMeta, FileRef, Metadata, TensorMeta
from ..layouts.boxes import Box
from .load_plan import check_chunks_tile, plan_reads
from .packed import PackedPlan, encode_rest
from .save_plan import GlobalPlan, build_global_plan


def _split(n: np.ndarray, parts: int, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths of part ``i`` of each ``n`` split like torch.chunk (uneven last)."""
    step = -(-n // parts)
    lo = np.minimum(n, i * step)
    return lo, np.minimum(n, lo + step) - lo


def _local_plan(rank: int, ranks: int, tp: int, table: bytes, shapes: np.ndarray) -> PackedPlan:
    """What ``rank`` sends, packed as a real rank packs it: one box per tensor it holds."""
    dp = ranks // tp
    d, t = divmod(rank, tp)
    r0, rn = _split(shapes[:, 0], dp, d)
    c0, cn = _split(shapes[:, 1], tp, t)
    held = (rn > 0) & (cn > 0)
    coords = np.stack([r0, c0, rn, cn], axis=1)[held]
    return PackedPlan(table, held.astype(np.int64), coords, encode_rest((), (), {}))


def simulate_fsdp_tp(
    ranks: int = 4096, tensors: int = 2000, tp: int = 8, tp_load: int = 4
) -> dict[str, Any]:
    """Plan a save of ``tensors`` matrices on ``ranks`` ranks (FSDP x TP ``tp``), then a load
    of it on as many ranks with TP ``tp_load``; report the costs."""
    shapes = np.array([(4096 + 512 * (i % 3), 4096) for i in range(tensors)], dtype=np.int64)
    table = json.dumps(
        [
            [f"model.layers.{i // 8}.w{i % 8}", "bfloat16", s, "dtensor"]
            for i, s in enumerate(shapes.tolist())
        ]
    ).encode()
    clock = _Clock()
    plans = [_local_plan(r, ranks, tp, table, shapes) for r in range(ranks)]
    local_s = clock.lap()
    signature = plans[0].signature()
    signature_s = clock.lap()
    exchanged = len(pickle.dumps(plans[0]))
    clock.lap()
    plan = build_global_plan(plans)
    plan_s, plan_cpu_s = clock.lap(), clock.cpu()
    del plans
    plan.group_by_rank()
    sample = sorted({round(i * (ranks - 1) / max(1, _SAMPLE - 1)) for i in range(_SAMPLE)})
    indexes: dict[int, bytes] = {}
    clock.lap()
    for rank in sample:
        indexes[rank] = _index(plan, rank)
    index_s = clock.lap() / len(sample)
    refs = [
        FileRef(f"data-0-{r:05d}.bin", plan.file_bytes(r), "i", len(indexes.get(r, b"")), "0")
        for r in range(ranks)
    ]
    clock.lap()
    meta = Metadata(
        world_size=ranks,
        files=tuple(r.data for r in refs),
        tensors={k: TensorMeta(d, s, lay, ()) for k, (d, s, lay) in plan.tensors.items()},
        objects={},
        per_rank={},
        segment_bytes=1 << 20,
        file_refs=tuple(refs),
    )
    raw = encode_metadata(meta)
    metadata_s = clock.lap()
    index_sizes = [len(b) for b in indexes.values()]
    report: dict[str, Any] = {
        "ranks": ranks,
        "tensors": tensors,
        "chunks": plan.chunks,
        "local_plans_all_ranks_s": round(local_s, 3),
        "first_save_exchange_bytes_per_rank": exchanged,
        "first_save_global_plan_s": round(plan_s, 3),
        "first_save_global_plan_cpu_s": round(plan_cpu_s, 3),
        "cached_save_exchange_bytes_per_rank": len(signature),
        "cached_save_signature_s": round(signature_s, 4),
        "per_save_rank_index_encode_s": round(index_s, 4),
        "per_save_coordinator_metadata_s": round(metadata_s, 4),
        "global_metadata_bytes": len(raw),
        "index_bytes_per_rank_max": max(index_sizes),
        "index_bytes_total_est": round(sum(index_sizes) * ranks / len(index_sizes)),
    }
    report.update(_load(plan, meta, indexes, tp_load))
    return report


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


def _index(plan: GlobalPlan, rank: int) -> bytes:
    entries = [
        (i.key, ChunkMeta(i.box.offsets, i.box.lengths, 0, i.byte_offset, i.nbytes, _sums(i)))
        for i in plan.writes(rank)
    ]
    return encode_index(f"data-0-{rank:05d}.bin", entries)


def _load(plan: GlobalPlan, meta: Metadata, indexes: dict[int, bytes], tp: int) -> dict[str, Any]:
    """A resharding restore on as many ranks, TP ``tp``: what one rank pays to learn where the
    saved chunks are (reading every index; estimated from the sampled files) and to plan its
    reads (measured: every tensor's chunks checked to tile it, indexed, matched)."""
    clock = _Clock()
    decoded = [decode_index(raw, "index", rank) for rank, raw in indexes.items()]
    assemble(meta, decoded)
    read_s = clock.lap() * plan.world_size / len(indexes)
    read_cpu_s = clock.cpu() * plan.world_size / len(indexes)
    saved = _assembled(plan, meta)
    clock.lap()
    dp = plan.world_size // tp
    d, t = divmod(plan.world_size - 1, tp)
    reads = 0
    for key, tensor in saved.tensors.items():
        index = check_chunks_tile(key, tensor)
        rows, cols = tensor.shape
        r0, rn = (int(x) for x in _split(np.array(rows), dp, d))
        c0, cn = (int(x) for x in _split(np.array(cols), tp, t))
        if not rn or not cn:
            continue
        dest = torch.empty((rn, cn), device="meta")
        pieces = [(Box((r0, c0), (rn, cn)), dest)]
        reads += len(plan_reads(key, tensor, saved.files, pieces, index))
    plan_s = clock.lap()
    return {
        "load_tp": tp,
        "load_read_indexes_s_est": round(read_s, 3),
        "load_read_indexes_cpu_s_est": round(read_cpu_s, 3),
        "load_plan_s": round(plan_s, 3),
        "load_plan_cpu_s": round(clock.cpu(), 3),
        "load_reads_per_rank": reads,
    }


def _assembled(plan: GlobalPlan, meta: Metadata) -> Metadata:
    """The metadata as a loading rank holds it after reading every index (byte offsets and
    checksums stand-ins: planning does not look at them)."""
    chunks: dict[str, list[ChunkMeta]] = {k: [] for k in plan.tensors}
    dims = plan.box_coords.shape[1] // 2
    for k, row, writer in zip(
        plan.box_keys.tolist(), plan.box_coords.tolist(), plan.box_writers.tolist()
    ):
        name = plan.names[k]
        lengths = tuple(row[dims:])
        nbytes = math.prod(lengths) * plan.itemsizes[name]
        chunks[name].append(ChunkMeta(tuple(row[:dims]), lengths, writer, 0, nbytes))
    tensors = {k: replace(t, chunks=tuple(chunks[k])) for k, t in meta.tensors.items()}
    return replace(meta, tensors=tensors)


def _sums(item: Any) -> tuple[str, ...]:
    return ("0123456789abcdef",) * max(1, -(-item.nbytes // (1 << 20)))
