"""Read once across nodes: which rank fetches the bytes that ranks of several nodes need.

Ranks of different nodes that load one checkpoint often need the same bytes (data-parallel
replicas need all of them). Each such byte is fetched from storage by one rank and reaches the
others over the process group (:mod:`unickpt.engine.node_exchange`), so n nodes read what one
node would.

Every rank reports its needs (:class:`~unickpt.planning.exchange_plan.RankNeeds`: each read
item's chunk and region, its node and the storage it reads), and every rank computes the same
plan from them (a pure function, no further exchange):

- A chunk that ranks of two or more nodes (of one storage) need bytes of is cut into *units*
  as the host exchange cuts them (segment-aligned byte ranges of at most ``unit_bytes`` covering
  what they need, each with the part every rank needs). Units of whole small chunks lying next to
  each other in one file and needed by the same ranks go together in one *fetch* (one read,
  one message to each receiver); every other unit is a fetch of its own.
- Fetches are placed largest first, each on the least loaded node among the nodes needing it
  (then the lowest), and there on the least loaded rank needing it (then the lowest): the
  *owner*, which reads it. No node reads more than its share plus one fetch. Every other rank
  needing part of it receives it.
- Fetches are cut into rounds, in file order: a rank's bytes of one round (read or received)
  stay within ``round_bytes`` unless one fetch alone is larger, which bounds the bytes in
  flight; the exchange reads and moves one round's fetches together, round after round.

A compressed chunk's unit is fetched alone: what moves is its stored segments (sizes known to
the ranks that read its index), planned by their raw size.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ..format.metadata import TensorMeta
from .exchange_plan import Cut, Part, RankNeeds, Unit, by_chunk_of, cut_chunk
from .save_plan import CHUNK_ALIGN

SMALL_SHARE = 16  # units under unit_bytes / 16 go together with their neighbours


@dataclass(frozen=True)
class Fetch:
    """Bytes ``[start, stop)`` of ``file`` (a compressed unit: its stored segments), read by
    ``owner`` in ``round`` and received by ``receivers``; ``units`` are the chunk ranges in it,
    each at ``offset`` of the fetched bytes."""

    file: str
    start: int
    stop: int
    owner: int
    round: int
    receivers: tuple[int, ...]
    units: tuple[Unit, ...]
    compressed: bool = False

    @property
    def nbytes(self) -> int:
        """The bytes it moves (a compressed unit: its raw size, an upper bound of sorts)."""
        return self.stop - self.start

    def takes_part(self, rank: int) -> bool:
        return rank == self.owner or rank in self.receivers


@dataclass(frozen=True)
class NodePlan:
    fetches: tuple[Fetch, ...]
    rounds: int

    def of(self, rank: int) -> list[Fetch]:
        """The fetches ``rank`` reads or receives, in plan order."""
        return [f for f in self.fetches if f.takes_part(rank)]

    def taken(self, rank: int) -> list[Fetch]:
        """:meth:`of`; raises if this rank planned one of them from a need's geometry alone
        (it then lacks the chunk's checksums, which only a bug could cause: a rank that takes
        part in a fetch needs its chunk, so has read its index)."""
        mine = self.of(rank)
        for f in mine:
            for u in f.units:
                if u.chunk.file < 0:
                    raise AssertionError(
                        f"rank {rank} takes part in a fetch of '{u.key}' in {u.file} without "
                        "having read the chunk's index"
                    )
        return mine

    @functools.cached_property
    def served(self) -> dict[int, frozenset[int]]:
        """Indices of each rank's needs the plan fills."""
        out: dict[int, set[int]] = {}
        for f in self.fetches:
            for u in f.units:
                for p in u.parts:
                    out.setdefault(p.rank, set()).add(p.need)
        return {r: frozenset(needs) for r, needs in out.items()}


def plan_node_reads(
    offers: Sequence[RankNeeds | None],
    tensors: Mapping[str, TensorMeta],
    files: Sequence[str],
    segment_bytes: int,
    unit_bytes: int,
    round_bytes: int,
) -> NodePlan:
    """The fetches of every chunk that ranks of two or more nodes of one storage need bytes of
    (the same on every rank; see the module's docstring)."""
    units: list[tuple[Unit, bool]] = []
    cuts: dict[tuple[object, ...], Cut] = {}
    node_of = {r: o.node for r, o in enumerate(offers) if o is not None}
    for ranks in _sources(offers).values():
        for (_, file, _), needs in sorted(by_chunk_of(offers, ranks, lambda *_: True).items()):
            if len({node_of[r] for r, _, _ in needs}) < 2:
                continue  # one node's: shared on its host, or read alone
            chunk, size, cut = cut_chunk(tensors, files, needs, segment_bytes, unit_bytes, cuts)
            compressed = any(n.compressed for _, _, n in needs)
            key = needs[0][2].key
            for lo, hi, where in cut:
                parts = tuple(Part(needs[k][0], needs[k][1], box) for k, box in where)
                units.append((Unit(key, file, chunk, size, lo, hi, -1, 0, 0, parts), compressed))
    fetches = _owned(_packed(units, unit_bytes), node_of)
    return _in_rounds(fetches, round_bytes)


def _sources(offers: Sequence[RankNeeds | None]) -> dict[str, list[int]]:
    """The ranks reading each storage, where they are on two or more nodes."""
    ranks: dict[str, list[int]] = {}
    nodes: dict[str, set[str]] = {}
    for rank, offer in enumerate(offers):
        if offer is not None and offer.source is not None and offer.needs:
            ranks.setdefault(offer.source, []).append(rank)
            nodes.setdefault(offer.source, set()).add(offer.node)
    return {s: rs for s, rs in sorted(ranks.items()) if len(nodes[s]) > 1}


def _ranks(u: Unit) -> tuple[int, ...]:
    return tuple(sorted({p.rank for p in u.parts}))


Packing = tuple[str, int, int, list[Unit], bool]


def _packed(units: list[tuple[Unit, bool]], limit: int) -> list[Packing]:
    """Units as fetches ``(file, start, stop, units, compressed)``: consecutive small units
    (under ``limit / SMALL_SHARE``) of one file needed by the same ranks, at most
    ``CHUNK_ALIGN`` bytes apart and together at most ``limit`` bytes, go together; others
    alone (a whole chunk then moves straight into place)."""
    order = sorted(units, key=lambda x: (x[0].file, x[0].chunk.byte_offset + x[0].lo))
    out: list[Packing] = []
    small = limit // SMALL_SHARE
    for u, compressed in order:
        start = u.chunk.byte_offset + u.lo
        stop = u.chunk.byte_offset + u.hi
        if out and not compressed and stop - start < small:
            file, first, last, group, alone = out[-1]
            if (
                not alone
                and all(x.hi - x.lo < small for x in group)
                and file == u.file
                and 0 <= start - last <= CHUNK_ALIGN
                and stop - first <= limit
                and _ranks(group[0]) == _ranks(u)
            ):
                out[-1] = (file, first, stop, [*group, u], False)
                continue
        out.append((u.file, start, stop, [u], compressed))
    return out


def _owned(fetches: list[Packing], node_of: Mapping[int, str]) -> list[Fetch]:
    """Each fetch on the least loaded node needing it (largest first), there on its least loaded
    rank needing it; in file order."""
    node_load: dict[str, int] = {}
    rank_load: dict[int, int] = {}
    order = sorted(range(len(fetches)), key=lambda i: (-(fetches[i][2] - fetches[i][1]), i))
    owners: dict[int, int] = {}
    first_rank: dict[str, int] = {}
    for r in sorted(node_of):
        first_rank.setdefault(node_of[r], r)
    for i in order:
        _, start, stop, group, _ = fetches[i]
        ranks = sorted({p.rank for u in group for p in u.parts})
        nodes = sorted(
            {node_of[r] for r in ranks}, key=lambda n: (node_load.get(n, 0), first_rank[n])
        )
        node = nodes[0]
        owner = min(
            (r for r in ranks if node_of[r] == node), key=lambda r: (rank_load.get(r, 0), r)
        )
        node_load[node] = node_load.get(node, 0) + stop - start
        rank_load[owner] = rank_load.get(owner, 0) + stop - start
        owners[i] = owner
    out = []
    for i, (file, start, stop, group, compressed) in enumerate(fetches):
        owner = owners[i]
        ranks = sorted({p.rank for u in group for p in u.parts})
        placed = tuple(
            replace(u, owner=owner, offset=u.chunk.byte_offset + u.lo - start) for u in group
        )
        receivers = tuple(r for r in ranks if r != owner)
        out.append(Fetch(file, start, stop, owner, 0, receivers, placed, compressed))
    return out


def _in_rounds(fetches: list[Fetch], round_bytes: int) -> NodePlan:
    """Each fetch (in file order) in the first round from its ranks' current ones where each
    of them has room for it (a fetch larger than ``round_bytes`` goes where they have none)."""
    used: dict[tuple[int, int], int] = {}
    current: dict[int, int] = {}
    out = []
    for f in fetches:
        ranks = (f.owner, *f.receivers)
        rnd = max(current.get(r, 0) for r in ranks)
        while any(
            used.get((r, rnd), 0) > 0 and used[r, rnd] + f.nbytes > round_bytes for r in ranks
        ):
            rnd += 1
        for r in ranks:
            used[r, rnd] = used.get((r, rnd), 0) + f.nbytes
            current[r] = rnd
        out.append(replace(f, round=rnd, units=tuple(replace(u, round=rnd) for u in f.units)))
    rounds = 1 + max((f.round for f in out), default=-1)
    return NodePlan(tuple(out), rounds)


__all__ = ["Fetch", "NodePlan", "plan_node_reads"]
