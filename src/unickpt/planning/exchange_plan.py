"""Read once, share on the host: which rank reads which part of a chunk that several ranks need.

When a rank needs only part of a saved chunk (a load into another layout), reading that part
alone costs more than its bytes: checksums cover whole segments, and many short runs are read
as one span. When several ranks on one host need parts of the same chunk, each would read and
hash the same segments. Instead the chunk is cut into *units* (segment-aligned byte ranges of
at most ``unit_bytes``); one rank, the *owner*, reads and verifies each unit once into a host
shared-memory buffer, and every rank copies its parts out of it.

The plan is a pure function of what every rank reported (its host group, the read items it
would amplify and the geometry of their chunks), so every rank computes the same plan without
another exchange, and without reading the indexes of chunks only other ranks need.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..format.dtypes import dtype_from_name, itemsize
from ..format.metadata import ChunkMeta, TensorMeta
from ..layouts.boxes import Box, flat_range_to_boxes, row_major_strides

_ALIGN = 64


@dataclass(frozen=True)
class Need:
    """A part of a saved chunk that one rank needs, and what reading it alone would cost.

    The chunk's box and size travel with it, so that a rank plans the units of chunks it does
    not read itself without reading their indexes (the plan needs only their geometry).
    ``direct``: the whole chunk into contiguous CPU memory (its bytes land in place);
    ``compressed``: the chunk is stored compressed; ``host``: ranks of one host share it
    (a read alone would cost more bytes than it needs, see :func:`plan_exchange`)."""

    key: str
    file: str
    byte_offset: int
    region: Box
    local_bytes: int
    chunk_box: Box
    chunk_nbytes: int
    direct: bool = False
    compressed: bool = False
    host: bool = True


@dataclass(frozen=True)
class RankNeeds:
    """What one rank reports: its host group (None: shares nothing with its host), its needs,
    its node and the storage it reads (``source``; None: shares nothing across nodes), and its
    ``read_piece_bytes`` (``piece``: the plan across nodes takes the largest of them, so ranks
    configured apart still plan alike)."""

    group: str | None
    token: str
    needs: tuple[Need, ...]
    node: str = ""
    source: str | None = None
    piece: int = 0


@dataclass(frozen=True)
class Part:
    """``box`` (global coordinates) of a unit goes to need ``need`` of ``rank``."""

    rank: int
    need: int
    box: Box


@dataclass(frozen=True)
class Unit:
    """Bytes ``[lo, hi)`` of ``chunk``, read by ``owner`` in ``round`` at ``offset`` of its
    buffer (``round % 2`` of two) and copied out in ``parts``."""

    key: str
    file: str
    chunk: ChunkMeta
    itemsize: int
    lo: int
    hi: int
    owner: int
    round: int
    offset: int
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class ExchangePlan:
    units: tuple[Unit, ...]
    rounds: int
    buffer_bytes: dict[int, int]
    tokens: dict[int, str]

    def taken(self, rank: int) -> list[Unit]:
        """The units ``rank`` reads or copies parts of. Raises if this rank planned one of them
        from a need's geometry alone: it then lacks the chunk's checksums, which only a bug could
        cause (a rank that takes part in a unit needs its chunk, so has read its index)."""
        mine = [u for u in self.units if u.owner == rank or any(p.rank == rank for p in u.parts)]
        for u in mine:
            if u.chunk.file < 0:
                raise AssertionError(
                    f"rank {rank} takes part in a unit of '{u.key}' in {u.file} without having "
                    "read the chunk's index"
                )
        return mine

    def exchanged(self, rank: int) -> frozenset[int]:
        """Indices of ``rank``'s needs that the exchange fills."""
        return frozenset(p.need for u in self.units for p in u.parts if p.rank == rank)


def plan_exchange(
    offers: Sequence[RankNeeds | None],
    tensors: dict[str, TensorMeta],
    files: Sequence[str],
    segment_bytes: int,
    unit_bytes: int,
    round_bytes: int,
    served: Mapping[int, frozenset[int]] | None = None,
) -> ExchangePlan:
    """Units for every chunk that two or more ranks of one host group need parts of, where
    reading it once costs fewer bytes than each rank reading its parts alone; owners balanced.
    Only needs marked ``host`` count, less those ``served`` already (indices per rank)."""
    units: list[Unit] = []
    load: dict[int, int] = {}
    cuts: dict[tuple[object, ...], Cut] = {}
    done = served or {}
    for ranks in _groups(offers).values():
        by_chunk = by_chunk_of(offers, ranks, lambda r, i, n: n.host and i not in done.get(r, ()))
        for (key, file, _), needs in sorted(by_chunk.items()):
            if len({r for r, _, _ in needs}) < 2:
                continue
            chunk, size, cut = cut_chunk(tensors, files, needs, segment_bytes, unit_bytes, cuts)
            if sum(hi - lo for lo, hi, _ in cut) >= sum(n.local_bytes for _, _, n in needs):
                continue
            for lo, hi, where in cut:
                parts = tuple(Part(needs[k][0], needs[k][1], box) for k, box in where)
                owner = _owner(parts, load)
                load[owner] = load.get(owner, 0) + hi - lo
                units.append(Unit(key, file, chunk, size, lo, hi, owner, 0, 0, parts))
    return _in_rounds(units, round_bytes, offers)


def _groups(offers: Sequence[RankNeeds | None]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for rank, offer in enumerate(offers):
        if offer is not None and offer.group is not None and offer.needs:
            groups.setdefault(offer.group, []).append(rank)
    return {g: r for g, r in sorted(groups.items()) if len(r) > 1}


NeedOf = tuple[int, int, Need]  # (rank, index of the need in the rank's needs, the need)
Cut = list[tuple[int, int, tuple[tuple[int, Box], ...]]]


def by_chunk_of(
    offers: Sequence[RankNeeds | None],
    ranks: Iterable[int],
    keep: Callable[[int, int, Need], bool],
) -> dict[tuple[str, str, int], list[NeedOf]]:
    """The needs of ``ranks`` that ``keep(rank, index, need)`` keeps, by chunk (key, file,
    offset), each chunk's in rank order."""
    out: dict[tuple[str, str, int], list[NeedOf]] = {}
    for rank in ranks:
        offer = offers[rank]
        assert offer is not None
        for i, need in enumerate(offer.needs):
            if keep(rank, i, need):
                out.setdefault((need.key, need.file, need.byte_offset), []).append((rank, i, need))
    return out


def cut_chunk(
    tensors: Mapping[str, TensorMeta],
    files: Sequence[str],
    needs: list[NeedOf],
    segment_bytes: int,
    unit_bytes: int,
    cuts: dict[tuple[object, ...], Cut],
) -> tuple[ChunkMeta, int, Cut]:
    """The chunk that ``needs`` (of one chunk) need parts of, its element size and its units
    (:func:`_cut`); chunks of tensors split alike, needed alike (every layer's), are cut once
    (``cuts`` remembers them)."""
    meta = tensors[needs[0][2].key]
    chunk = _chunk(meta, files, needs[0][2])
    size = itemsize(dtype_from_name(meta.dtype))
    same = (chunk.lengths, chunk.offsets, chunk.nbytes, size)
    name = same + tuple((r, n.region) for r, _, n in needs)
    cut = cuts.get(name)
    if cut is None:
        cut = cuts[name] = _cut(chunk, size, needs, segment_bytes, unit_bytes)
    return chunk, size, cut


def _chunk(meta: TensorMeta, files: Sequence[str], need: Need) -> ChunkMeta:
    """The need's chunk as this rank's metadata has it (with its checksums: every rank that
    reads or copies a unit needs its chunk, so has read its index), else its geometry alone:
    this rank plans that chunk's units but takes no part in them (its file number is then -1,
    as this rank may not number the file; units name their file)."""
    for chunk in meta.chunks:
        if chunk.byte_offset == need.byte_offset and files[chunk.file] == need.file:
            return chunk
    box = need.chunk_box
    return ChunkMeta(box.offsets, box.lengths, -1, need.byte_offset, need.chunk_nbytes)


def flat_span(chunk: ChunkMeta, box: Box) -> tuple[int, int]:
    """Elements ``[first, end)`` of ``chunk``'s row-major storage that ``box`` spans."""
    return _span(row_major_strides(chunk.lengths), chunk.offsets, box)


def _span(strides: tuple[int, ...], origin: tuple[int, ...], box: Box) -> tuple[int, int]:
    first = last = 0
    for o, n, c, s in zip(box.offsets, box.lengths, origin, strides):
        first += (o - c) * s
        last += (o - c + n - 1) * s
    return first, last + 1


def _cut(chunk: ChunkMeta, size: int, needs: list[NeedOf], segment: int, unit_bytes: int) -> Cut:
    """The chunk's needed bytes as segment-aligned units, each with the parts ranks need (as
    positions in ``needs`` and boxes)."""
    strides, origin = row_major_strides(chunk.lengths), chunk.offsets
    spans = [_span(strides, origin, n.region) for _, _, n in needs]
    lo0 = min(f for f, _ in spans) * size // segment * segment
    hi0 = max(e for _, e in spans) * size
    out = []
    for ulo in range(lo0, hi0, unit_bytes):
        uhi = min(ulo + unit_bytes, _up(hi0, segment), chunk.nbytes)
        boxes = [
            Box(tuple(o + c for o, c in zip(b.offsets, origin)), b.lengths)
            for b in flat_range_to_boxes(chunk.lengths, ulo // size, (uhi - ulo) // size)
        ]
        parts, first, end = [], uhi, ulo
        for k, ((_, _, need), (nfirst, nend)) in enumerate(zip(needs, spans)):
            if nend * size <= ulo or nfirst * size >= uhi:
                continue  # the need's span misses the unit: no box of it can overlap
            for b in boxes:
                x = b.intersect(need.region)
                if x is not None:
                    parts.append((k, x))
                    xfirst, xend = _span(strides, origin, x)
                    first, end = min(first, xfirst * size), max(end, xend * size)
        if not parts:
            continue
        lo = max(ulo, first // segment * segment)
        hi = min(uhi, _up(end, segment))
        out.append((lo, hi, tuple(parts)))
    return out


def _up(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


def _owner(parts: tuple[Part, ...], load: dict[int, int]) -> int:
    """The least loaded rank that needs part of the unit; among equals, the one needing most."""
    wanted: dict[int, int] = {}
    for p in parts:
        wanted[p.rank] = wanted.get(p.rank, 0) + p.box.numel
    return min(wanted, key=lambda r: (load.get(r, 0), -wanted[r], r))


def _in_rounds(
    units: list[Unit], round_bytes: int, offers: Sequence[RankNeeds | None]
) -> ExchangePlan:
    """Each owner's units packed into rounds of at most ``round_bytes`` of its buffer."""
    state: dict[int, tuple[int, int]] = {}
    sizes: dict[int, int] = {}
    placed = []
    for u in units:
        rnd, used = state.get(u.owner, (0, 0))
        n = _up(u.hi - u.lo, _ALIGN)
        if used and used + n > round_bytes:
            rnd, used = rnd + 1, 0
        placed.append(
            Unit(u.key, u.file, u.chunk, u.itemsize, u.lo, u.hi, u.owner, rnd, used, u.parts)
        )
        state[u.owner] = (rnd, used + n)
        sizes[u.owner] = max(sizes.get(u.owner, 0), used + n)
    rounds = 1 + max((u.round for u in placed), default=-1)
    tokens = {r: o.token for r, o in enumerate(offers) if o is not None and r in sizes}
    return ExchangePlan(tuple(placed), rounds, sizes, tokens)
