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

Compaction: every ``full_every``-th save of a rank is full (writes every chunk). The basis lives
in memory; a Checkpointer's first save starts from the newest committed checkpoint of its root
(:meth:`Basis.seed`, from its indexes: the checksums recorded there stand for the bytes), so a
restarted job's first save refers to it too; without one that save is full. An index records
the checksums of a compressed chunk's stored bytes only: that save compresses the chunk as it
was stored and compares the stored checksums (compression is deterministic), then keeps the
raw ones for the saves after.
Retention keeps every step a kept checkpoint refers to.

Memory: the basis and a save's digests hold one 16-character checksum per segment (1 MiB) plus
about 200 bytes per chunk; no tensor bytes are kept or copied (a source that is not contiguous
CPU memory is copied once for hashing and again for writing, as the write path does).

Changed rows only: an embedding table's save writes the rows that changed since the last.
For a 2-D chunk whose key matches one of a Checkpointer's ``row_deltas`` patterns, each save
computes a 64-bit digest of every row (every byte of it, mixed nonlinearly; computed with torch
over blocks of rows) and compares it with the row digests of the previous save. Runs of changed
rows are written as chunks of their own; runs of unchanged rows refer to the bytes where the
previous saves left them (the rows of a base chunk, or of an earlier run), one hop away, as
boxes of whole rows: the format needs nothing beyond references (docs/format.md), and loading,
resharding, ``verify`` and ``convert`` see an ordinary tiling of the table into row boxes.

A table is written whole (a new base) when it has no previous digests, when more than
``MAX_CHANGED_FRACTION`` of its rows changed, or when its changed rows plus the index entries
of its pieces (``PIECE_INDEX_BYTES`` each) would cost more than ``MAX_CHANGED_FRACTION`` of the
whole table; the Checkpointer's ``full_every`` compacts every table as well.

Memory: 8 bytes per row of each tracked chunk are kept between saves (the row digests), plus
one small record per piece; while digesting, about three blocks of ``BLOCK_ROWS`` rows as int64
words. The pieces of one table are one entry of the rank's index (``runs`` in
docs/format.md): per piece its row count, file, byte offset and checksum, about 35 bytes of
JSON, so scattered changes to narrow (quantized) rows still cost index bytes comparable to the
rows themselves.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase

import torch

from ..format.metadata import ChunkMeta, Compression, Metadata
from ..format.references import FileLocation, parse_reference
from ..layouts.boxes import Box
from ..planning.save_plan import CHUNK_ALIGN, WriteItem
from .checksum import checksums_of, hash_items
from .compress import pack
from .data_file import WriteResult
from .sources import ItemSource

log = logging.getLogger(__name__)

BLOCK_ROWS = 1 << 14
MAX_CHANGED_FRACTION = 0.5
PIECE_INDEX_BYTES = 40

_K1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_K2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_K3 = -7723592293110705685  # 0x94D049BB133111EB


@dataclass(frozen=True)
class StoredChunk:
    """The bytes of a chunk saved earlier: ``nbytes`` at ``byte_offset`` of ``location``.

    A compressed chunk keeps its ``compression`` and the checksums of its raw bytes
    (``raw_checksums``, what a save compares; ``checksums`` cover the stored bytes)."""

    location: FileLocation
    byte_offset: int
    nbytes: int
    checksums: tuple[str, ...]
    compression: Compression | None = None
    raw_checksums: tuple[str, ...] = ()

    @property
    def content(self) -> tuple[str, ...]:
        """The checksums of the chunk's raw bytes, as a save hashes them."""
        return self.raw_checksums or self.checksums


_Chunks = dict[tuple[str, Box], StoredChunk]


@dataclass(frozen=True)
class StoredRows:
    """A table saved as row pieces: rows ``[start, stop)`` lie in each piece's chunk, and the
    digest of every row (:func:`row_digests`) at that save."""

    pieces: tuple[tuple[int, int, StoredChunk], ...]
    digests: torch.Tensor


class Basis:
    """What one rank of a Checkpointer saved last; decides each save's kind (full or not).

    Keys matching one of ``row_patterns`` (:func:`fnmatch.fnmatchcase`) whose chunks are 2-D
    are compared row by row (see the module's docstring).
    """

    def __init__(self, full_every: int, row_patterns: Sequence[str] = ()) -> None:
        if full_every < 1:
            raise ValueError(f"full_every is {full_every}; expected at least 1")
        self.full_every = full_every
        self.row_patterns = tuple(row_patterns)
        self.chunks: _Chunks = {}
        self.rows: dict[tuple[str, Box], StoredRows] = {}
        self.segment_bytes = 0
        self.since_full = 0

    def seed(self, step: str, meta: Metadata) -> None:
        """Start from the committed checkpoint of step folder ``step`` (a restarted job): its
        chunks, where their bytes lie and their checksums, as if this rank had saved it, so
        the next save refers to its unchanged chunks. Row digests are not stored: tables
        compared row by row are written whole once, then row by row again."""
        chunks: _Chunks = {}
        for key, t in meta.tensors.items():
            for c in t.chunks:
                name = meta.files[c.file]
                where = parse_reference(name) or FileLocation(step, name)
                chunks[(key, c.box)] = StoredChunk(
                    where, c.byte_offset, c.nbytes, c.checksums, c.compression
                )
        self.chunks, self.rows = chunks, {}
        self.segment_bytes = meta.segment_bytes
        self.since_full = len(meta.references)  # at least the saves since its last full one

    def tracks_rows(self, item: WriteItem) -> bool:
        return (
            item.box.ndim == 2
            and item.box.lengths[0] > 1
            and any(fnmatchcase(item.key, p) for p in self.row_patterns)
        )

    def next_save(
        self, step: str, segment_bytes: int, committed: Callable[[str], bool]
    ) -> IncrementalSave:
        """The save of step folder ``step``: full when the chain is due for compaction.

        Chunks stored in a step folder that ``committed`` denies (deleted, uncommitted by a
        failed load's clean-up) or in ``step`` itself (being replaced) are written again.
        """
        full = (
            not (self.chunks or self.rows)
            or segment_bytes != self.segment_bytes
            or self.since_full + 1 >= self.full_every
        )
        if full:
            return IncrementalSave(self, step, True, {}, {}, segment_bytes)
        steps = {c.location.step for c in self.chunks.values()}
        steps |= {c.location.step for r in self.rows.values() for _, _, c in r.pieces}
        alive = {s for s in steps - {step} if committed(s)}
        known = {k: c for k, c in self.chunks.items() if c.location.step in alive}
        rows = {
            k: r
            for k, r in self.rows.items()
            if all(c.location.step in alive for _, _, c in r.pieces)
        }
        return IncrementalSave(self, step, False, known, rows, segment_bytes)


@dataclass
class IncrementalSave:
    """One save of a rank: which chunks to skip, and the basis it leaves once committed."""

    basis: Basis
    step: str
    full: bool
    known: _Chunks
    known_rows: dict[tuple[str, Box], StoredRows]
    segment_bytes: int
    written: _Chunks = field(default_factory=dict)
    written_rows: dict[tuple[str, Box], StoredRows] = field(default_factory=dict)
    referenced_steps: tuple[str, ...] = ()

    def changes(
        self,
        items: Sequence[WriteItem],
        sources: Sequence[ItemSource],
        compress: Sequence[bool],
        threads: int,
    ) -> Changed | None:
        """What this save writes of ``items`` (``compress``: which are compressed where
        written) and what it refers to; None for a full save, which writes every item as
        planned (the row digests of its tables are taken, for the next save to compare with).
        """
        if self.full:
            for it, src in zip(items, sources):
                if self.basis.tracks_rows(it):
                    digests = row_digests(src.contiguous_bytes(), it.box.lengths[0])
                    self.written_rows[(it.key, it.box)] = StoredRows((), digests)
            return None
        return _changed(self._pieces_of(items, sources, threads), compress)

    def _pieces_of(
        self, items: Sequence[WriteItem], sources: Sequence[ItemSource], threads: int
    ) -> list[list[Piece]]:
        """Each item as pieces: to write (with their checksums) or stored already. An item is
        its stored chunk when their raw checksums match or, for a compressed chunk read from
        an index, when it compresses alike; a table compared by rows is cut into runs."""
        seg = self.segment_bytes
        tables = [self.basis.tracks_rows(it) for it in items]
        plain = [i for i, table in enumerate(tables) if not table]
        stored = {i: c for i in plain if (c := self._stored(items[i])) is not None}
        # A compressed chunk read from an index records the checksums of its stored bytes only.
        unknown = [i for i, c in stored.items() if c.compression and not c.raw_checksums]
        packed = same_when_packed(
            [sources[i] for i in unknown], [stored[i] for i in unknown], seg, threads
        )
        same = dict(zip(unknown, packed))
        out: list[list[Piece]] = [[] for _ in items]
        for i, table in enumerate(tables):
            if table:
                out[i] = self._row_pieces(items[i], sources[i])
        sums = hash_items(
            [sources[i] for i in plain], [items[i].nbytes for i in plain], seg, threads
        )
        for i, digests in zip(plain, sums):
            c = stored.get(i)
            kept = c is not None and same.get(i, c.content == digests)
            chunk = replace(c, raw_checksums=digests) if c is not None and kept else None
            out[i] = [Piece(items[i].box, chunk, sources[i], digests)]
        return out

    def _stored(self, item: WriteItem) -> StoredChunk | None:
        """The stored chunk of ``item``'s key and box, of its size; None without one."""
        found = self.known.get((item.key, item.box))
        return found if found is not None and found.nbytes == item.nbytes else None

    def _row_pieces(self, item: WriteItem, source: ItemSource) -> list[Piece]:
        rows = item.box.lengths[0]
        data = source.contiguous_bytes()
        digests = row_digests(data, rows)
        self.written_rows[(item.key, item.box)] = StoredRows((), digests)
        before = self.known_rows.get((item.key, item.box))
        row_bytes = item.nbytes // rows
        pieces: list[Piece] = []
        if before is not None and before.digests.shape == digests.shape:
            changed = digests != before.digests
            if int(changed.sum()) <= MAX_CHANGED_FRACTION * rows:
                pieces = self._pieces(item, source, data, row_bytes, changed, before)
        written = sum(p.box.lengths[0] for p in pieces if p.stored is None) * row_bytes
        # The pieces pay when they and their index entries cost less than the table whole.
        cost = written + len(pieces) * PIECE_INDEX_BYTES
        if not pieces or cost > MAX_CHANGED_FRACTION * item.nbytes:
            return [Piece(item.box, None, source, checksums_of(data, self.segment_bytes))]
        return pieces

    def _pieces(
        self,
        item: WriteItem,
        source: ItemSource,
        data: torch.Tensor,
        row_bytes: int,
        changed: torch.Tensor,
        before: StoredRows,
    ) -> list[Piece]:
        seg = self.segment_bytes
        starts = [p0 for p0, _, _ in before.pieces]  # the pieces tile the rows, in order
        out = []
        for a, b, is_changed in changed_runs(changed):
            if is_changed:
                rows = ItemSource(source.view[a:b])
                sums = checksums_of(data[a * row_bytes : b * row_bytes], seg)
                out.append(Piece(sub_box(item.box, a, b), None, rows, sums))
                continue
            for j in range(bisect_right(starts, a) - 1, len(starts)):
                p0, p1, stored = before.pieces[j]
                if p0 >= b:
                    break
                lo, hi = max(a, p0), min(b, p1)
                if (lo, hi) != (p0, p1):
                    offset = stored.byte_offset + (lo - p0) * row_bytes
                    sums = checksums_of(data[lo * row_bytes : hi * row_bytes], seg)
                    stored = StoredChunk(stored.location, offset, (hi - lo) * row_bytes, sums)
                out.append(Piece(sub_box(item.box, lo, hi), stored, None, stored.checksums))
        return out

    def record(
        self,
        data_file: str,
        items: Sequence[WriteItem],
        chunks: Sequence[Sequence[ChunkMeta]],
        refs: Sequence[FileLocation],
        raw: Sequence[tuple[str, ...]] = (),
    ) -> None:
        """Remember where this save's chunks lie (adopted by :meth:`adopt` once committed);
        ``raw[i]``, the checksums of item ``i``'s raw bytes where it was compressed."""
        own = FileLocation(self.step, data_file)

        def stored(c: ChunkMeta, sums: tuple[str, ...] = ()) -> StoredChunk:
            where = refs[c.file - 1] if c.file else own
            content = sums if c.compression is not None else ()
            return StoredChunk(where, c.byte_offset, c.nbytes, c.checksums, c.compression, content)

        for i, (it, cs) in enumerate(zip(items, chunks)):
            key = (it.key, it.box)
            digests = self.written_rows.get(key)
            if digests is None:
                self.written[key] = stored(cs[0], raw[i] if i < len(raw) else ())
                continue
            first = it.box.offsets[0]
            pieces = tuple(
                (c.offsets[0] - first, c.offsets[0] - first + c.lengths[0], stored(c)) for c in cs
            )
            self.written_rows[key] = StoredRows(pieces, digests.digests)
        self.referenced_steps = tuple(sorted({r.step for r in refs}))

    def adopt(self) -> None:
        """The save is committed: later saves compare against it."""
        b = self.basis
        b.chunks, b.rows, b.segment_bytes = self.written, self.written_rows, self.segment_bytes
        b.since_full = b.since_full + 1 if self.referenced_steps else 0


@dataclass(frozen=True)
class Piece:
    """A box of an item: ``stored`` already (referred to) or written from ``source``."""

    box: Box
    stored: StoredChunk | None
    source: ItemSource | None
    checksums: tuple[str, ...]


@dataclass(frozen=True)
class Changed:
    """What an incremental save writes: the changed pieces laid out back to back (``items``,
    read from ``sources``, with their ``checksums``; ``compress``, which are compressed), and
    the chunks of every planned item, a written one in file 0 (in order) and an unchanged one
    in the file ``refs`` numbers from 1; ``content``, the raw checksums of each item saved
    whole."""

    items: tuple[WriteItem, ...]
    sources: list[ItemSource]
    checksums: list[tuple[str, ...]]
    compress: list[bool]
    chunks: list[list[ChunkMeta]]
    refs: list[FileLocation]
    content: list[tuple[str, ...]]

    def placed(self, result: WriteResult) -> list[list[ChunkMeta]]:
        """The chunks, those written placed and compressed as the write of ``result`` stored
        them; unchanged when it stored them as laid out."""
        if not result.placed:
            return self.chunks
        written = iter(zip(result.placed, result.checksums))
        out = []
        for cs in self.chunks:
            row = []
            for c in cs:
                if c.file == 0:
                    (at, packed), sums = next(written)
                    c = replace(c, byte_offset=at, checksums=sums, compression=packed)
                row.append(c)
            out.append(row)
        return out


def _changed(pieces: list[list[Piece]], compress: Sequence[bool]) -> Changed:
    """The pieces to write, laid out back to back, and the chunks of every item."""
    writes = [p for ps in pieces for p in ps if p.stored is None]
    sources = [p.source for p in writes if p.source is not None]
    laid = relaid(
        [
            WriteItem("", p.box, 0, s.view.numel() * s.view.element_size())
            for p, s in zip(writes, sources)
        ]
    )
    refs = sorted({p.stored.location for ps in pieces for p in ps if p.stored is not None})
    number = {loc: n + 1 for n, loc in enumerate(refs)}
    at = iter(laid)
    chunks: list[list[ChunkMeta]] = []
    for ps in pieces:
        out = []
        for p in ps:
            if p.stored is None:
                it = next(at)
                c = ChunkMeta(
                    p.box.offsets, p.box.lengths, 0, it.byte_offset, it.nbytes, p.checksums
                )
            else:
                s = p.stored
                c = ChunkMeta(
                    p.box.offsets,
                    p.box.lengths,
                    number[s.location],
                    s.byte_offset,
                    s.nbytes,
                    s.checksums,
                    s.compression,
                )
            out.append(c)
        chunks.append(out)
    log.debug(
        "incremental save: %d pieces written, %d referred to",
        len(writes),
        sum(map(len, pieces)) - len(writes),
    )
    return Changed(
        laid,
        sources,
        [p.checksums for p in writes],
        [f for f, ps in zip(compress, pieces) for p in ps if p.stored is None],
        chunks,
        refs,
        [ps[0].checksums if len(ps) == 1 else () for ps in pieces],  # raw, by the plan
    )


def relaid(items: Sequence[WriteItem]) -> tuple[WriteItem, ...]:
    """``items`` laid out back to back in a new file (each at a multiple of CHUNK_ALIGN)."""
    offset = 0
    out = []
    for it in items:
        offset = -(-offset // CHUNK_ALIGN) * CHUNK_ALIGN
        out.append(WriteItem(it.key, it.box, offset, it.nbytes))
        offset += it.nbytes
    return tuple(out)


def same_when_packed(
    sources: Sequence[ItemSource], stored: Sequence[StoredChunk], segment: int, threads: int
) -> list[bool]:
    """Whether each source, compressed as its stored chunk was (same grouping, zstd level), is
    that chunk: the same stored segment sizes and checksums. Compression is deterministic, so
    equal raw bytes compress alike (a zstd of another version may not: the chunk is then
    written again, as a changed one)."""
    if not sources:
        return []

    def run(n: int) -> bool:
        c = stored[n].compression
        assert c is not None
        data = sources[n].contiguous_bytes().numpy()
        found = pack(data, c.width, segment)
        return found.compression == c and found.checksums == stored[n].checksums

    with ThreadPoolExecutor(threads, thread_name_prefix="unickpt-hash") as pool:
        return list(pool.map(run, range(len(sources))))


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shift(x, 30)
    x = x * _K2
    x = x ^ _shift(x, 27)
    x = x * _K3
    return x ^ _shift(x, 31)


def row_digests(data: torch.Tensor, rows: int) -> torch.Tensor:
    """A 64-bit digest of each of the ``rows`` equal rows of the bytes ``data`` (int64)."""
    if rows == 0:
        return torch.empty(0, dtype=torch.int64)
    table = data.reshape(rows, -1)
    width = table.shape[1]
    words = -(-width // 8)
    salt = torch.arange(1, words + 1, dtype=torch.int64) * _K1
    out = torch.empty(rows, dtype=torch.int64)
    for lo in range(0, rows, BLOCK_ROWS):
        block = table[lo : lo + BLOCK_ROWS]
        if width % 8:
            padded = torch.zeros(block.shape[0], words * 8, dtype=torch.uint8)
            padded[:, :width] = block
            block = padded
        x = block.contiguous().view(torch.int64) + salt
        out[lo : lo + block.shape[0]] = _mix(_mix(x).sum(dim=1))
    return out


def changed_runs(changed: torch.Tensor) -> list[tuple[int, int, bool]]:
    """Maximal runs ``(start, stop, changed)`` of a boolean row mask."""
    n = changed.numel()
    if n == 0:
        return []
    cuts = (torch.nonzero(changed[1:] != changed[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, n]
    flags = changed[torch.tensor(bounds[:-1])].tolist()
    return [(a, b, bool(f)) for a, b, f in zip(bounds[:-1], bounds[1:], flags)]


def sub_box(box: Box, start: int, stop: int) -> Box:
    """Rows ``[start, stop)`` of a 2-D box (counted from the box's first row)."""
    return Box((box.offsets[0] + start, *box.offsets[1:]), (stop - start, *box.lengths[1:]))
