"""The write phase of a save: this rank's data file and its index, both durable.

A full save writes every item where the plan laid it out (:mod:`unickpt.engine.data_file`:
parts on parallel threads, or a compressed stream), from the item sources or from the bytes a
bounded ring staged. An incremental save (:mod:`unickpt.engine.incremental`) hashes every item
first, writes only the changed pieces, back to back, and refers to where the unchanged ones
already lie. The index (chunks, references, checksums) is written once every part is, while the
data file is completed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..config import Config
from ..engine.checksum import digest
from ..engine.commit import data_name, index_name
from ..engine.data_file import WriteResult, write_file
from ..engine.incremental import IncrementalSave, Piece, relaid
from ..engine.sources import ItemSource, StagedParts
from ..engine.timeline import Timeline
from ..format.codec import encode_index
from ..format.metadata import ChunkMeta, FileRef
from ..format.references import FileLocation
from ..planning.save_plan import WriteItem
from ..storage.base import Storage
from .plan import PlannedSave

log = logging.getLogger(__name__)

_WriteIndex = Callable[..., None]


def write_rank_files(
    storage: Storage,
    planned: PlannedSave,
    sources: list[ItemSource],
    config: Config,
    incremental: IncrementalSave | None = None,
    compress: bool = False,
    progress: Callable[[int, int], None] | None = None,
    stager: StagedParts | None = None,
    timeline: Timeline | None = None,
) -> FileRef:
    """This rank's data file and its index; what the commit records of them. With ``stager``
    (a plain full save), the file's bytes come through its bounded ring."""
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

    flags = _compressed(compress, incremental, items)
    if incremental is None or incremental.full:
        if incremental is not None:
            incremental.digest_rows(items, sources)

        def write_full_index(result: WriteResult) -> None:
            chunks = [
                [ChunkMeta(i.box.offsets, i.box.lengths, 0, at, i.nbytes, sums, packed)]
                for i, sums, (at, packed) in zip(items, result.checksums, result.placements(items))
            ]
            write_index(result, chunks, [], result.raw_checksums)

        write_file(
            storage,
            name,
            items,
            sources,
            config,
            progress,
            alongside=write_full_index,
            compress=flags,
            stager=stager,
            timeline=timeline,
        )
    else:
        if stager is not None:
            raise AssertionError("an incremental save is not staged through a bounded ring")
        _write_changed(
            storage,
            name,
            items,
            sources,
            config,
            incremental,
            flags,
            progress,
            write_index,
            timeline,
        )
    return written[0]


def _write_changed(
    storage: Storage,
    name: str,
    items: tuple[WriteItem, ...],
    sources: list[ItemSource],
    config: Config,
    inc: IncrementalSave,
    flags: list[bool],
    progress: Callable[[int, int], None] | None,
    write_index: _WriteIndex,
    timeline: Timeline | None = None,
) -> None:
    """Hash every item, write the changed pieces back to back, refer to the others; the index
    is written with ``write_index`` while the data file is completed."""
    pieces = inc.plan(items, sources, config.io_threads)
    writes = [p for ps in pieces for p in ps if p.stored is None]
    laid = relaid([WriteItem("", p.box, 0, _nbytes(p)) for p in writes])
    write_sources = [p.source for p in writes if p.source is not None]
    refs = sorted({p.stored.location for ps in pieces for p in ps if p.stored is not None})
    number = {loc: n + 1 for n, loc in enumerate(refs)}
    at = iter(laid)
    content = [ps[0].checksums if len(ps) == 1 else () for ps in pieces]  # raw, by the plan
    chunks: list[list[ChunkMeta]] = []
    for ps in pieces:
        out = []
        for p in ps:
            if p.stored is None:
                it = next(at)
                out.append(
                    ChunkMeta(
                        p.box.offsets, p.box.lengths, 0, it.byte_offset, it.nbytes, p.checksums
                    )
                )
            else:
                s = p.stored
                out.append(
                    ChunkMeta(
                        p.box.offsets,
                        p.box.lengths,
                        number[s.location],
                        s.byte_offset,
                        s.nbytes,
                        s.checksums,
                        s.compression,
                    )
                )
        chunks.append(out)
    log.debug(
        "incremental save: %d pieces written, %d referred to",
        len(writes),
        sum(map(len, pieces)) - len(writes),
    )
    write_file(
        storage,
        name,
        laid,
        write_sources,
        config,
        progress,
        [p.checksums for p in writes],
        alongside=lambda result: write_index(result, _placed(chunks, result), refs, content),
        compress=[f for f, ps in zip(flags, pieces) for p in ps if p.stored is None],
        timeline=timeline,
    )


def _compressed(
    compress: bool, inc: IncrementalSave | None, items: Sequence[WriteItem]
) -> list[bool]:
    """Which items are compressed where written: all with ``compress``, but those of tables
    an incremental save compares row by row (later saves refer to rows of their bytes)."""
    return [compress and not (inc and inc.basis.tracks_rows(it)) for it in items]


def _placed(chunks: list[list[ChunkMeta]], result: WriteResult) -> list[list[ChunkMeta]]:
    """The chunks, those written (``file`` 0, in order) placed and compressed as the write
    of ``result`` stored them; unchanged when it stored them as laid out."""
    if not result.placed:
        return chunks
    written = iter(zip(result.placed, result.checksums))
    out = []
    for cs in chunks:
        row = []
        for c in cs:
            if c.file == 0:
                (at, packed), sums = next(written)
                c = replace(c, byte_offset=at, checksums=sums, compression=packed)
            row.append(c)
        out.append(row)
    return out


def _nbytes(p: Piece) -> int:
    assert p.source is not None
    return p.source.view.numel() * p.source.view.element_size()
