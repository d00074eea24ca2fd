"""Memberships of a job and how they change: pure decisions, the same wherever they are made.

A process is a *slot* ``<gen>.<node>.<k>``: its generation (a full restart starts the next),
the index of its node, and its place among the node's processes (its ``LOCAL_RANK``, the
device it would take). A membership maps the slots that train to ranks ``0 .. world - 1``;
the other live slots of its generation are spares. The first membership of a generation gives
node ``i``'s first ``nproc`` slots the ranks after those of the nodes before it, as torchrun
does. After a failure the survivors keep their ranks and each lost rank goes to a spare: one
of its own node when there is one (its node's memory holds its files), else one of the node
with the most spares left.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NodeSpec:
    """One node of the job, as its launcher registered it."""

    name: str
    nproc: int
    spares: int


def slot_name(gen: int, node: int, k: int) -> str:
    return f"{gen}.{node}.{k}"


def slot_parts(slot: str) -> tuple[int, int, int]:
    """``(gen, node, k)`` of a slot name."""
    gen, node, k = (int(x) for x in slot.split("."))
    return gen, node, k


@dataclass(frozen=True)
class Membership:
    """Who trains in epoch ``epoch``: slot -> rank. ``why``: what started it."""

    epoch: int
    gen: int
    ranks: dict[str, int] = field(default_factory=dict)
    why: str = ""

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def slot_of(self, rank: int) -> str:
        return next(s for s, r in self.ranks.items() if r == rank)

    def local_world(self, node: int) -> int:
        """How many ranks train on ``node``."""
        return sum(1 for s in self.ranks if slot_parts(s)[1] == node)

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "gen": self.gen, "ranks": self.ranks, "why": self.why}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Membership:
        ranks = {str(s): int(r) for s, r in doc["ranks"].items()}
        return Membership(int(doc["epoch"]), int(doc["gen"]), ranks, str(doc.get("why", "")))


def slots(gen: int, nodes: Sequence[NodeSpec]) -> list[str]:
    """Every process slot of generation ``gen``: each node's workers, then its spares."""
    return [slot_name(gen, i, k) for i, n in enumerate(nodes) for k in range(n.nproc + n.spares)]


def first_membership(epoch: int, gen: int, nodes: Sequence[NodeSpec], why: str) -> Membership:
    """Generation ``gen`` starts: node ``i``'s first ``nproc`` slots train, in node order."""
    ranks: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for k in range(node.nproc):
            ranks[slot_name(gen, i, k)] = len(ranks)
    return Membership(epoch, gen, ranks, why)


def spares(m: Membership, nodes: Sequence[NodeSpec], dead: Iterable[str]) -> list[str]:
    """The live slots of ``m``'s generation that do not train in ``m``."""
    gone = set(dead)
    return [s for s in slots(m.gen, nodes) if s not in m.ranks and s not in gone]


def replace(
    m: Membership, lost: Iterable[str], alive_spares: Sequence[str], why: str
) -> Membership | str:
    """The next membership: each rank of a ``lost`` slot given to a spare (its node's when it
    has one, else one of the node with the most spares left); or why there is none."""
    gone = sorted(set(lost), key=lambda s: m.ranks[s])
    if len(gone) > len(alive_spares):
        named = ", ".join(str(m.ranks[s]) for s in gone)
        return (
            f"no spare left: {len(gone)} rank(s) lost ({named}), {len(alive_spares)} spare(s) alive"
        )
    free: dict[int, list[str]] = {}
    for s in sorted(alive_spares, key=slot_parts):
        free.setdefault(slot_parts(s)[1], []).append(s)
    ranks = {s: r for s, r in m.ranks.items() if s not in gone}
    for s in gone:
        node = slot_parts(s)[1]
        if not free.get(node):  # the node with most spares left, the first of equals
            node = max(free, key=lambda n: (len(free[n]), -n))
        ranks[free[node].pop(0)] = m.ranks[s]
        if not free[node]:
            del free[node]
    return Membership(m.epoch + 1, m.gen, dict(sorted(ranks.items(), key=lambda x: x[1])), why)
