"""Incremental saves: chunks whose bytes did not change since the last save are not written.

Each rank of a Checkpointer with ``incremental=True`` keeps a :class:`Basis`: for every chunk
it wrote or referred to in its last committed save, where the bytes lie (step folder, data
file, byte offset), their size and their checksums (xxh3-64 per segment). A save then hashes
each chunk it is about to write (the whole chunk, every segment: these digests are also the
checksums the index records, so no byte is hashed twice) and compares them with the basis: a
chunk with the same key, box, size and checksums is not written; the new index refers to the
bytes where they already lie (:mod:`unickpt.format.references`). References always point at the
file that holds the bytes, never at a checkpoint that itself refers on, so reading one costs one
hop; a checkpoint depends on at most the steps saved since the last full one.

Compaction: every ``full_every``-th save of a rank is full (writes every chunk), and so is the
first save of a Checkpointer (the basis lives in memory: a restarted job starts a new chain).
Retention keeps every step a kept checkpoint refers to.

Memory: the basis and a save's digests hold one 16-character checksum per segment (1 MiB) plus
about 200 bytes per chunk; no tensor bytes are kept or copied (a source that is not contiguous
CPU memory is copied once for hashing and again for writing, as the write path does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..format.dtypes import buffer_of
from ..format.metadata import ChunkMeta
from ..format.references import FileLocation
from ..layouts.boxes import Box
from ..planning.save_plan import CHUNK_ALIGN, WriteItem
from .checksum import segment_digests
from .write import ItemSource

_HASH_PIECE_SEGMENTS = 64


@dataclass(frozen=True)
class StoredChunk:
    """The bytes of a chunk saved earlier: ``nbytes`` at ``byte_offset`` of ``location``."""

    location: FileLocation
    byte_offset: int
    nbytes: int
    checksums: tuple[str, ...]


_Chunks = dict[tuple[str, Box], StoredChunk]


class Basis:
    """What one rank of a Checkpointer saved last; decides each save's kind (full or not)."""

    def __init__(self, full_every: int) -> None:
        if full_every < 1:
            raise ValueError(f"full_every is {full_every}; expected at least 1")
        self.full_every = full_every
        self.chunks: _Chunks = {}
        self.segment_bytes = 0
        self.since_full = 0

    def next_save(
        self, step: str, segment_bytes: int, committed: Callable[[str], bool]
    ) -> IncrementalSave:
        """The save of step folder ``step``: full when the chain is due for compaction.

        Chunks stored in a step folder that ``committed`` denies (deleted, uncommitted by a
        failed load's clean-up) or in ``step`` itself (being replaced) are written again.
        """
        full = (
            not self.chunks
            or segment_bytes != self.segment_bytes
            or self.since_full + 1 >= self.full_every
        )
        if full:
            return IncrementalSave(self, step, True, {}, segment_bytes)
        steps = {c.location.step for c in self.chunks.values()} - {step}
        alive = {s for s in steps if committed(s)}
        known = {k: c for k, c in self.chunks.items() if c.location.step in alive}
        return IncrementalSave(self, step, False, known, segment_bytes)


@dataclass
class IncrementalSave:
    """One save of a rank: which chunks to skip, and the basis it leaves once committed."""

    basis: Basis
    step: str
    full: bool
    known: _Chunks
    segment_bytes: int
    written: _Chunks = field(default_factory=dict)
    referenced_steps: tuple[str, ...] = ()

    def split(
        self, items: Sequence[WriteItem], digests: Sequence[tuple[str, ...]]
    ) -> tuple[list[int], list[tuple[int, StoredChunk]]]:
        """Indexes of the items to write, and the items whose bytes are stored already."""
        write: list[int] = []
        same: list[tuple[int, StoredChunk]] = []
        for i, (item, sums) in enumerate(zip(items, digests)):
            stored = self.known.get((item.key, item.box))
            if stored is not None and stored.nbytes == item.nbytes and stored.checksums == sums:
                same.append((i, stored))
            else:
                write.append(i)
        return write, same

    def record(
        self, data_file: str, entries: Sequence[tuple[str, ChunkMeta]], refs: Sequence[FileLocation]
    ) -> None:
        """Remember where this save's chunks lie (adopted by :meth:`adopt` once committed)."""
        own = FileLocation(self.step, data_file)
        self.written = {
            (key, c.box): StoredChunk(
                refs[c.file - 1] if c.file else own, c.byte_offset, c.nbytes, c.checksums
            )
            for key, c in entries
        }
        self.referenced_steps = tuple(sorted({r.step for r in refs}))

    def adopt(self) -> None:
        """The save is committed: later saves compare against it."""
        b = self.basis
        b.chunks, b.segment_bytes = self.written, self.segment_bytes
        b.since_full = b.since_full + 1 if self.referenced_steps else 0


def relaid(items: Sequence[WriteItem]) -> tuple[WriteItem, ...]:
    """``items`` laid out back to back in a new file (each at a multiple of CHUNK_ALIGN)."""
    offset = 0
    out = []
    for it in items:
        offset = -(-offset // CHUNK_ALIGN) * CHUNK_ALIGN
        out.append(WriteItem(it.key, it.box, offset, it.nbytes))
        offset += it.nbytes
    return tuple(out)


def hash_items(
    sources: Sequence[ItemSource], nbytes: Sequence[int], segment: int, threads: int
) -> list[tuple[str, ...]]:
    """Every item's checksums (xxh3-64 per segment), hashed in pieces on ``threads`` threads."""
    step = segment * _HASH_PIECE_SEGMENTS
    tasks = [
        (i, start)
        for i, (src, n) in enumerate(zip(sources, nbytes))
        for start in (range(0, max(n, 1), step) if src.direct else (0,))
    ]

    def run(task: tuple[int, int]) -> list[str]:
        i, start = task
        src = sources[i]
        data = src.contiguous_bytes()
        stop = start + step if src.direct else nbytes[i]
        return segment_digests(buffer_of(data[start:stop]), segment)

    with ThreadPoolExecutor(threads, thread_name_prefix="unickpt-hash") as pool:
        pieces = list(pool.map(run, tasks))
    out: list[list[str]] = [[] for _ in sources]
    for (i, _), sums in zip(tasks, pieces):
        out[i] += sums
    return [tuple(s) for s in out]
