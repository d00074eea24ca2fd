"""Which ranks share a node, and where each rank's replicas go (GEMINI's group placement).

A node is the set of ranks with the same :func:`unickpt.dist.node_name` (``UNICKPT_NODE``, else
the host name; see docs/architecture.md, "Nodes"). Nodes are numbered by their lowest rank. The
node's first rank (its leader) does the node-wide housekeeping: writing the commit copy,
listing, deleting.

Placement for ``m`` copies (the original and ``m - 1`` replicas): the nodes are cut into
groups of ``m`` consecutive nodes (the remainder joins the last group); within a group of ``g``
nodes, node ``i`` sends its ranks' files to nodes ``i + 1 ... i + m - 1`` (mod ``g``). Every
file then lives on ``m`` distinct nodes of one group, so any ``m - 1`` nodes may fail at once
(GEMINI, SOSP 2023, group placement). Rank ``j`` of a node sends to rank ``j`` (mod the size)
of the receiving node.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Nodes:
    """The ranks of a group (group ranks ``0 .. n-1``) by node, as seen by ``rank``."""

    rank: int
    members: tuple[tuple[int, ...], ...]

    @staticmethod
    def from_names(rank: int, names: list[str]) -> Nodes:
        order: dict[str, list[int]] = {}
        for r, name in enumerate(names):
            order.setdefault(name, []).append(r)
        return Nodes(rank, tuple(tuple(rs) for rs in order.values()))

    @property
    def count(self) -> int:
        return len(self.members)

    def node_of(self, rank: int) -> int:
        return next(i for i, rs in enumerate(self.members) if rank in rs)

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def leader(self, node: int) -> int:
        return self.members[node][0]

    @property
    def is_leader(self) -> bool:
        return self.leader(self.node) == self.rank

    def groups(self, copies: int) -> list[list[int]]:
        """Nodes cut into groups of ``copies`` (the remainder joins the last group)."""
        n = self.count
        if copies <= 1 or n < 2:
            return [[i] for i in range(n)]
        size = min(copies, n)
        groups = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        if len(groups) > 1 and len(groups[-1]) < size:
            groups[-2].extend(groups.pop())
        return groups

    def sends(self, copies: int) -> list[tuple[int, int]]:
        """Every (source rank, replica rank) pair, in one order all ranks agree on."""
        pairs = []
        for group in self.groups(copies):
            g = len(group)
            for i, node in enumerate(group):
                for k in range(1, min(copies, g)):
                    target = self.members[group[(i + k) % g]]
                    for j, src in enumerate(self.members[node]):
                        pairs.append((src, target[j % len(target)]))
        return pairs
