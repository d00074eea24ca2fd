"""A restart from memory: the newest step complete across what survived, missing files from peers.

1. Every node's leader reports what its folder holds (:meth:`MemoryStore.holdings`); the
   coordinator adds the storage's newest committed step; all ranks gather the same picture.
2. The newest memory step whose data files are all present on some surviving node wins, when it
   is at least as new as storage's; every rank computes the same answer.
3. Nodes that lack its commit get it (healing); every rank gets the index files its node lacks
   (small, kept in memory: a node folder's index file always means its data is whole).
4. Each rank plans its load (resharding included) and names the data files it reads that its
   node lacks; each such file is sent once per node, rank to rank, into the node's folder, its
   index written after it (healing the replica).
5. Every rank loads from its node folder with the normal load path.

Peak extra memory: the gathered index files; fetched files land in the node folder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.commit import read_checkpoint
from ..engine.loader import files_needed
from ..storage.base import Storage, WriteHandle
from .group import TierGroup, Transfer
from .memory import Holding, MemoryStore, index_of
from .nodes import Nodes
from .replicate import Committed, read_committed, write_commit


@dataclass(frozen=True)
class Choice:
    """The memory step to restore: which nodes hold its commit and which data files."""

    step: int
    metadata_file: str
    commit_nodes: tuple[int, ...]
    holders: dict[str, tuple[int, ...]]


def choose(held: Sequence[Sequence[Holding]]) -> Choice | None:
    """The newest step with a commit somewhere and every data file present somewhere."""
    candidates: dict[tuple[int, str], list[int]] = {}
    required: dict[tuple[int, str], tuple[str, ...]] = {}
    for node, holdings in enumerate(held):
        for h in holdings:
            if h.metadata_file is not None:
                candidates.setdefault((h.step, h.metadata_file), []).append(node)
                required[(h.step, h.metadata_file)] = h.required
    for key in sorted(candidates, reverse=True):
        step = key[0]
        holders = {
            f: tuple(
                n for n, hs in enumerate(held) for h in hs if h.step == step and f in h.present
            )
            for f in required[key]
        }
        if all(holders.values()):
            return Choice(step, key[1], tuple(candidates[key]), holders)
    return None


def survey(
    group: TierGroup, nodes: Nodes, store: MemoryStore, storage_steps: Callable[[], list[int]]
) -> tuple[list[list[Holding]], int | None]:
    """What every node holds, and storage's newest committed step (the same on every rank)."""
    mine = store.holdings() if nodes.is_leader else []
    newest = None
    if group.rank == 0:
        steps = storage_steps()
        newest = steps[-1] if steps else None
    gathered = group.all_gather((mine, newest))
    held = [gathered[nodes.leader(n)][0] for n in range(nodes.count)]
    return held, gathered[0][1]


def fetch(
    group: TierGroup, nodes: Nodes, store: MemoryStore, choice: Choice, state: dict[str, Any]
) -> tuple[Storage, bool]:
    """Bring what this rank's load needs into its node folder; the storage to load from and
    whether any file this rank reads came from a peer."""
    source = nodes.leader(choice.commit_nodes[0])
    committed = group.broadcast(
        read_committed(store, choice.step) if group.rank == source else None, source
    )
    assert committed is not None
    here = nodes.node
    if nodes.is_leader and here not in choice.commit_nodes:
        write_commit(store, committed)
    indexes = _indexes(group, nodes, store, choice, committed)
    folder = store.step(choice.step)
    view = WithIndexes(folder, indexes)
    _, meta = read_checkpoint(view)
    needed = files_needed(meta, state)
    missing = sorted(f for f in needed if here not in choice.holders[f])
    wanted = group.all_gather(missing)
    transfers = _transfers(nodes, store, choice, committed, wanted)
    group.exchange(transfers)
    for t in transfers:
        if t.send:
            continue
        name = t.path.name
        folder.write_atomic(index_of(name), indexes[index_of(name)])
    group.barrier()  # files fetched by one rank of a node serve its other ranks too
    return view, bool(missing)


def _indexes(
    group: TierGroup, nodes: Nodes, store: MemoryStore, choice: Choice, committed: Committed
) -> dict[str, bytes]:
    """Index files this node lacks, from the first node that holds each (gathered once)."""
    folder = store.step_path(choice.step)
    offered: dict[str, bytes] = {}
    for ref in committed.refs:
        holders = choice.holders[ref.data]
        if len(holders) < nodes.count and group.rank == nodes.leader(holders[0]):
            offered[ref.index] = (folder / ref.index).read_bytes()
    everything: dict[str, bytes] = {}
    for part in group.all_gather(offered):
        everything.update(part)
    here = nodes.node
    return {
        r.index: everything[r.index] for r in committed.refs if here not in choice.holders[r.data]
    }


def _transfers(
    nodes: Nodes,
    store: MemoryStore,
    choice: Choice,
    committed: Committed,
    wanted: list[list[str]],
) -> list[Transfer]:
    """Each file a node needs, once: from a holder rank (spread over the holder's ranks) to the
    node's first rank that asked. The same list on every rank."""
    sizes = {r.data: r.nbytes for r in committed.refs}
    folder = store.step_path(choice.step)
    transfers: list[Transfer] = []
    seen: set[tuple[int, str]] = set()
    tag = 0
    for rank, files in enumerate(wanted):
        node = nodes.node_of(rank)
        for f in files:
            if (node, f) in seen:
                continue
            seen.add((node, f))
            holder = nodes.members[choice.holders[f][0]]
            src = holder[tag % len(holder)]
            if nodes.rank == src:
                transfers.append(Transfer(folder / f, sizes[f], rank, tag, True))
            elif nodes.rank == rank:
                (folder / index_of(f)).unlink(missing_ok=True)
                transfers.append(Transfer(folder / f, sizes[f], src, tag, False))
            tag += 1
    if any(not t.send for t in transfers):
        folder.mkdir(parents=True, exist_ok=True)
    return transfers


class WithIndexes(Storage):
    """A node's step folder with the index files it lacks served from memory (read-only)."""

    def __init__(self, base: Storage, extra: dict[str, bytes]) -> None:
        self.base = base
        self.extra = extra
        self.maps_files = base.maps_files
        self.cheap_reads = base.cheap_reads

    @property
    def location(self) -> str:
        return self.base.location

    def child(self, name: str) -> Storage:
        return self.base.child(name)

    def list_names(self) -> list[str]:
        return sorted(set(self.base.list_names()) | set(self.extra))

    def size(self, name: str) -> int | None:
        raw = self.extra.get(name)
        return len(raw) if raw is not None else self.base.size(name)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.base.read_into(name, offset, out)

    def map_range(self, name: str, offset: int, length: int) -> memoryview | None:
        return self.base.map_range(name, offset, length)

    def read_bytes(self, name: str) -> bytes | None:
        raw = self.extra.get(name)
        return raw if raw is not None else self.base.read_bytes(name)

    def write_atomic(self, name: str, data: bytes) -> None:
        self.base.write_atomic(name, data)

    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        return self.base.create(name, part_sizes)

    def remove(self, name: str) -> None:
        self.base.remove(name)

    def remove_many(self, names: Sequence[str]) -> None:
        self.base.remove_many(names)

    def remove_tree(self, name: str) -> None:
        self.base.remove_tree(name)

    def close(self) -> None:
        self.base.close()
