"""The write phase of a save (:func:`write`): this rank's data file and its index, both durable.

A full save writes every item where the plan laid it out (:mod:`unickpt.engine.data_file`:
parts on parallel threads, or a compressed stream), from the item sources or from the bytes a
bounded ring staged. An incremental save (:mod:`unickpt.engine.incremental`) hashes every item
first, writes only the changed pieces, back to back, and refers to where the unchanged ones
already lie. The index (chunks, references, checksums) is written once every part is, while the
data file is completed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..engine.checksum import digest
from ..engine.commit import data_name, index_name
from ..engine.data_file import WriteResult, write_file
from ..engine.incremental import IncrementalSave
from ..engine.timeline import Timeline
from ..format.codec import encode_index
from ..format.metadata import ChunkMeta, FileRef
from ..format.references import FileLocation
from ..planning.save_plan import WriteItem
from .commit import Written
from .copy import Copy
from .plan import PlannedSave
from .save import Save


def write(save: Save, planned: PlannedSave, copied: Copy) -> Written:
    """Phase 4: this rank's files, or the error that stopped them (the commit reports it to
    every rank)."""
    timeline = Timeline()
    timeline.add("plan", planned.plan_s)
    t0 = time.perf_counter()
    ref, error = None, None
    try:
        if copied.check is not None:
            copied.check()
        if planned.items:
            ref = _write_files(save, planned, copied, timeline)
        if copied.check is not None:
            copied.check()
    except Exception as e:  # noqa: BLE001 - reported to every rank
        error = e
    finally:
        if copied.stager is not None:
            copied.stager.stop()  # the snapshot is over, whatever happened
    return Written(ref, error, time.perf_counter() - t0, timeline)


def _write_files(save: Save, planned: PlannedSave, copied: Copy, timeline: Timeline) -> FileRef:
    """This rank's data file and its index; what the commit records of them. With a stager
    (a plain full save), the file's bytes come through its bounded ring."""
    storage, config, incremental = save.storage, save.config, save.options.incremental
    items, save_id, rank = planned.items, planned.save_id, planned.comm.rank
    name = data_name(save_id, rank)
    written: list[FileRef] = []

    def write_index(
        result: WriteResult,
        chunks: list[list[ChunkMeta]],
        refs: list[FileLocation],
        content: Sequence[tuple[str, ...]] = (),
    ) -> None:
        if incremental is not None:
            incremental.record(name, items, chunks, refs, content)
        entries = [(it.key, cs[0]) for it, cs in zip(items, chunks) if len(cs) == 1]
        runs = [(it.key, cs) for it, cs in zip(items, chunks) if len(cs) > 1]  # row deltas
        raw = encode_index(name, entries, refs, runs)
        index = index_name(save_id, rank)
        storage.write_atomic(index, raw)
        written.append(FileRef(name, result.nbytes, index, len(raw), digest(memoryview(raw))))

    def write_full_index(result: WriteResult) -> None:
        chunks = [
            [ChunkMeta(i.box.offsets, i.box.lengths, 0, at, i.nbytes, sums, packed)]
            for i, sums, (at, packed) in zip(items, result.checksums, result.placements(items))
        ]
        write_index(result, chunks, [], result.raw_checksums)

    o = save.options
    sources = copied.sources
    flags = _compressed(o.compress, incremental, items)
    changed = None
    if incremental is not None:
        changed = incremental.changes(items, sources, flags, config.io_threads)
    if changed is None:
        write_file(
            storage,
            name,
            items,
            sources,
            config,
            o.progress,
            alongside=write_full_index,
            compress=flags,
            stager=copied.stager,
            timeline=timeline,
        )
    else:
        if copied.stager is not None:
            raise AssertionError("an incremental save is not staged through a bounded ring")
        write_file(
            storage,
            name,
            changed.items,
            changed.sources,
            config,
            o.progress,
            changed.checksums,
            alongside=lambda r: write_index(r, changed.placed(r), changed.refs, changed.content),
            compress=changed.compress,
            timeline=timeline,
        )
    return written[0]


def _compressed(
    compress: bool, inc: IncrementalSave | None, items: Sequence[WriteItem]
) -> list[bool]:
    """Which items are compressed where written: all with ``compress``, but those of tables
    an incremental save compares row by row (later saves refer to rows of their bytes)."""
    return [compress and not (inc and inc.basis.tracks_rows(it)) for it in items]
