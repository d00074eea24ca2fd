"""What one rank of a resharding restore pays to plan its reads, at scale, on real files.

The checkpoint of a simulated first save (:func:`unickpt.planning.simulate.simulate_save`) is
written to a folder as a save leaves it: the commit marker, the global metadata (with its chunk
map), and the index files this rank reads (the others are never opened; their sizes and
checksums in the metadata are stand-ins). One rank of a restore on as many ranks with another
TP degree then does what a load does before reading data: read and check the marker and the
metadata, find the saved chunks it needs, read and decode the indexes listing them, check that
the chunks tile every tensor, and match its boxes against them (its read items). The figures
are CPU seconds of this process (``time.process_time``).

For a checkpoint without a chunk map a rank reads and decodes every index; that cost is
estimated from the sampled index files, decoded into arrays as the load does and, for
comparison, into one object per chunk as before.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.checksum import digest
from ..engine.commit import read_metadata
from ..engine.indexes import SavedChunks
from ..format.codec import assemble, decode_index, encode_commit, encode_metadata
from ..format.index_arrays import decode_index_arrays
from ..format.metadata import CommitRecord, FileRef, Metadata
from ..layouts.boxes import Box
from ..planning.load_plan import ChunkIndex, plan_reads
from ..planning.simulate import SimulatedSave, encode_rank_index, split
from ..storage.local import LocalStorage


def restore_figures(save: SimulatedSave, tp: int, rank: int | None = None) -> dict[str, Any]:
    """Plan the reads of ``rank`` (default: the last) of a restore on as many ranks, TP
    ``tp``, of the simulated save; its figures."""
    plan, meta = save.plan, save.meta
    world = plan.world_size
    rank = world - 1 if rank is None else rank
    wanted = _wanted(meta, world, tp, rank)
    with tempfile.TemporaryDirectory(prefix="unickpt-restore-plan-") as folder:
        files = _write_checkpoint(Path(folder), save, wanted)
        storage = LocalStorage(Path(folder))
        cpu = time.process_time()
        _, loaded = read_metadata(storage)
        metadata_cpu = time.process_time() - cpu
        chunks = SavedChunks(storage, loaded)
        assembled = chunks.load({k: [b for b, _ in pieces] for k, pieces in wanted.items()})
        indexes_cpu = time.process_time() - cpu - metadata_cpu
        reads = 0
        for key, pieces in wanted.items():
            saved = assembled.tensors[key]
            index = ChunkIndex(saved.chunks)
            reads += len(plan_reads(key, saved, assembled.files, pieces, index))
        total_cpu = time.process_time() - cpu
        read = len(chunks.files_read)
    arrays_cpu, objects_cpu = _all_indexes_cpu(save)
    return {
        "restore_tp": tp,
        "restore_plan_cpu_s": round(total_cpu, 3),
        "restore_metadata_cpu_s": round(metadata_cpu, 3),
        "restore_indexes_cpu_s": round(indexes_cpu, 3),
        "restore_match_cpu_s": round(total_cpu - metadata_cpu - indexes_cpu, 3),
        "restore_index_files_read": read,
        "restore_index_files_needed": len(files),
        "restore_reads_per_rank": reads,
        "restore_without_map_indexes_cpu_s_est": round(arrays_cpu, 3),
        "restore_without_map_indexes_as_objects_cpu_s_est": round(objects_cpu, 3),
    }


def _wanted(
    meta: Metadata, world: int, tp: int, rank: int
) -> dict[str, list[tuple[Box, torch.Tensor]]]:
    """The boxes ``rank`` of an FSDP x TP ``tp`` job of ``world`` ranks holds of each tensor,
    with (storage-less) destinations."""
    d, t = divmod(rank, tp)
    out: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    for key, tensor in meta.tensors.items():
        rows, cols = tensor.shape
        r0, rn = (int(x) for x in split(np.array(rows), world // tp, d))
        c0, cn = (int(x) for x in split(np.array(cols), tp, t))
        pieces = []
        if rn and cn:
            pieces.append((Box((r0, c0), (rn, cn)), torch.empty((rn, cn), device="meta")))
        out[key] = pieces
    return out


def _write_checkpoint(
    folder: Path, save: SimulatedSave, wanted: dict[str, list[tuple[Box, torch.Tensor]]]
) -> set[int]:
    """The marker, the metadata and the index files listing chunks ``wanted`` overlaps (the
    files, found from the chunk map)."""
    meta = save.meta
    assert meta.chunk_map is not None
    needed: set[int] = set()
    for key, pieces in wanted.items():
        layout = meta.chunk_map.layout(key)
        assert layout is not None
        for box, _ in pieces:
            needed.update(layout.files[layout.overlapping(box.offsets, box.lengths)].tolist())
    refs = list(meta.file_refs)
    for i in sorted(needed):
        raw = save.indexes.get(i) or encode_rank_index(save.plan, i)
        name = f"index-0-{i:05d}.json"
        (folder / name).write_bytes(raw)
        refs[i] = FileRef(refs[i].data, refs[i].nbytes, name, len(raw), digest(memoryview(raw)))
    raw = encode_metadata(replace(meta, file_refs=tuple(refs)))
    (folder / "metadata-0.json").write_bytes(raw)
    record = CommitRecord("metadata-0.json", len(raw), digest(memoryview(raw)), "0")
    (folder / "COMMIT").write_bytes(encode_commit(record))
    return needed


def _all_indexes_cpu(save: SimulatedSave) -> tuple[float, float]:
    """CPU seconds to decode every index of the save into arrays, and into objects (and
    assemble them), estimated from the sampled indexes."""
    sample = save.indexes
    scale = save.plan.world_size / len(sample)
    cpu = time.process_time()
    for i, raw in sample.items():
        decode_index_arrays(raw, "index", i)
    arrays = (time.process_time() - cpu) * scale
    cpu = time.process_time()
    assemble(save.meta, [decode_index(raw, "index", i) for i, raw in sample.items()])
    objects = (time.process_time() - cpu) * scale
    return arrays, objects
