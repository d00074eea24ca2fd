"""Planning at scale without processes: an FSDP x TP job of many ranks, simulated.

Every rank's local plan is built as that rank would (TP splits the columns of each matrix,
FSDP splits the TP block's rows), then the global plan and the metadata are built exactly as a
save does. Reports the time of each step and the metadata size.

>>> simulate_fsdp_tp(ranks=64, tensors=20)["chunks"]
1280
"""

from __future__ import annotations

import time
from typing import Any

from ..format.codec import encode_index, encode_metadata
from ..format.metadata import ChunkMeta, FileRef, Metadata, TensorMeta
from ..layouts.boxes import Box
from .save_plan import LocalPlan, TensorDecl, build_global_plan


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Offset and length of part ``i`` of ``n`` split like torch.chunk (uneven last part)."""
    step = -(-n // parts)
    lo = min(n, i * step)
    return lo, min(n, lo + step) - lo


def _local_plan(rank: int, ranks: int, tp: int, shapes: list[tuple[int, int]]) -> LocalPlan:
    dp = ranks // tp
    d, t = divmod(rank, tp)
    tensors = {}
    for i, (rows, cols) in enumerate(shapes):
        c0, cn = _split(cols, tp, t)
        r0, rn = _split(rows, dp, d)
        boxes = (Box((r0, c0), (rn, cn)),) if rn and cn else ()
        tensors[f"model.layers.{i // 8}.w{i % 8}"] = TensorDecl(
            "bfloat16", (rows, cols), "dtensor", boxes
        )
    return LocalPlan(tensors, (), ())


def simulate_fsdp_tp(ranks: int = 4096, tensors: int = 2000, tp: int = 8) -> dict[str, Any]:
    """Plan a save of ``tensors`` matrices on ``ranks`` ranks (FSDP x TP); report the costs."""
    shapes = [(4096 + 512 * (i % 3), 4096) for i in range(tensors)]
    t0 = time.perf_counter()
    plans = [_local_plan(r, ranks, tp, shapes) for r in range(ranks)]
    t1 = time.perf_counter()
    signatures = [p.signature() for p in plans[:1]]
    t_sig = time.perf_counter() - t1
    t2 = time.perf_counter()
    plan = build_global_plan(plans)
    t3 = time.perf_counter()
    refs = []
    index_bytes = []
    for rank in range(ranks):
        items = plan.writes(rank)
        entries = [
            (i.key, ChunkMeta(i.box.offsets, i.box.lengths, 0, i.byte_offset, i.nbytes, _sums(i)))
            for i in items
        ]
        if rank == 0:
            t_index = time.perf_counter()
            raw_index = encode_index(f"data-0-{rank}.bin", entries)
            t_index = time.perf_counter() - t_index
        else:
            raw_index = encode_index(f"data-0-{rank}.bin", entries)
        index_bytes.append(len(raw_index))
        refs.append(
            FileRef(
                f"data-0-{rank:05d}.bin", sum(i.nbytes for i in items), "i", len(raw_index), "0"
            )
        )
    t4 = time.perf_counter()
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
    t5 = time.perf_counter()
    return {
        "ranks": ranks,
        "tensors": tensors,
        "chunks": sum(len(b) for b in plan.written_boxes),
        "local_plans_all_ranks_s": round(t1 - t0, 3),
        "first_save_global_plan_s": round(t3 - t2, 3),
        "cached_save_exchange_bytes_per_rank": len(signatures[0]),
        "cached_save_signature_s": round(t_sig, 4),
        "per_save_rank_index_encode_s": round(t_index, 4),
        "per_save_coordinator_metadata_s": round(t5 - t4, 4),
        "global_metadata_bytes": len(raw),
        "index_bytes_per_rank_max": max(index_bytes),
        "index_bytes_total": sum(index_bytes),
    }


def _sums(item: Any) -> tuple[str, ...]:
    return ("0123456789abcdef",) * max(1, -(-item.nbytes // (1 << 20)))
