"""A restart from memory: the newest step complete across what survived, missing files from peers.

1. Every node's leader reports what its folder holds (:meth:`MemoryStore.holdings`); the
   coordinator adds the storage's newest committed step; all ranks gather the same picture.
2. The newest memory step whose data files are all present on some surviving node wins, when it
   is at least as new as storage's; every rank computes the same answer.
3. A broadcast brings its commit to every rank (written by the leaders of the nodes that lack
   it: healing). Each rank finds, from the metadata's chunk map, the index files its load reads
   that its node lacks, and gets those alone, each from a rank of a node that holds it (kept in
   memory: a node folder's index file always means its data is whole). What moves grows with
   what each rank loads, not with the world's size.
4. Each rank plans its load (resharding included) and names the data files it reads that its
   node lacks; each such file is sent once per node, rank to rank. When every read of it is a
   whole chunk into the state and only the receiving rank reads it (a restart into the layout
   that saved), only those chunks are sent, straight into the state's tensors
   (:mod:`unickpt.tiers.direct`), and no file is made: the peer's copy keeps serving it until
   the node's next memory save. Otherwise the whole file goes into the node's folder (on a
   recycled spare when the node has one), its index written after it (healing the replica).
5. Every rank loads with the normal load path (checksums verified). When only the receiving
   rank reads a fetched file, the load runs while the bytes arrive, each read waiting for its
   own (:class:`Fetch`): a restore from a peer then takes about the transfer plus the
   verification of its last piece.

Peak extra memory: the commit and metadata, the index files this rank's load reads that its node
lacks, and a scratch piece for runs of small chunks; whole fetched files land in the node folder.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..dist import run_step
from ..engine.load import RankReads
from ..engine.read_chunks import is_direct
from ..errors import CheckpointCorruptError
from ..format.dtypes import byte_view
from ..format.metadata import COMMIT_FILE
from ..planning.load_plan import ReadItem
from ..storage.base import Storage, StorageView
from .direct import Targets
from .group import Arrivals, Pass, TierGroup, Transfer
from .memory import Holding, MemoryStore, folder_errors, index_of
from .nodes import Nodes
from .replicate import Committed, read_committed, write_commit

Ranges = tuple[tuple[int, int], ...]
_PLANNING = "planning the restore from memory"


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
    group: TierGroup,
    nodes: Nodes,
    store: MemoryStore | None,
    storage_steps: Callable[[], list[int]],
) -> tuple[list[list[Holding]], int | None]:
    """What every node holds, and storage's newest committed step (the same on every rank).
    A node's folder or storage's listing that cannot be read fails the survey on every rank.
    ``store`` is None before the root has an identity (nothing in memory is this root's)."""

    def look() -> tuple[None, tuple[list[Holding], int | None]]:
        mine = store.holdings() if nodes.is_leader and store is not None else []
        newest = None
        if group.rank == 0:
            steps = storage_steps()
            newest = steps[-1] if steps else None
        return None, (mine, newest)

    _, gathered = run_step(group, "looking for the newest checkpoint", look)
    held = [gathered[nodes.leader(n)][0] for n in range(nodes.count)]
    return held, gathered[0][1]


class Fetch:
    """The files one restore brings from peers: the storage to load from (:attr:`view`), the
    step's commit (:attr:`committed`), and :meth:`finish` after the load.

    When every fetched file is read by the rank that receives it only (``alongside``), the
    transfers run in a thread of their own while the load reads: each read waits for its bytes
    to arrive, so verifying and copying a piece overlaps the transfer of the next. Otherwise
    (another rank of the node reads a file this rank receives) the transfers finish, the
    indexes are written and every rank passes a barrier before the load starts.
    """

    def __init__(
        self,
        group: TierGroup,
        folder: Storage,
        path: Path,
        committed: Committed,
        indexes: dict[str, bytes],
        transfers: list[Transfer],
        alongside: bool,
        fetched: bool,
        received: tuple[str, ...] = (),
        targets: Targets | None = None,
    ) -> None:
        self.committed = committed
        self.fetched = fetched  # this rank reads files its node lacks
        self.received = received  # the files this rank receives from other nodes
        self._group = group
        self._folder = folder
        self._indexes = indexes
        self._transfers = transfers
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        receiving = {t.path: t.nbytes for t in transfers if not t.send}
        arrivals = Arrivals(receiving) if alongside and receiving else None
        self._targets = targets
        self.view = WithIndexes(folder, indexes, path, arrivals, targets)
        if not alongside:  # files fetched by one rank of a node serve its other ranks too
            run_step(group, f"receiving the files of memory step {committed.step}", self._receive)
        elif transfers:
            self._thread = threading.Thread(
                target=self._run, args=(arrivals,), name="unickpt-fetch", daemon=True
            )
            self._thread.start()

    def _run(self, arrivals: Arrivals | None) -> None:
        try:
            arrived = arrivals.arrived if arrivals else None
            self._group.exchange(self._transfers, arrived, self._targets)
        except BaseException as e:  # noqa: BLE001 - raised by finish, on the loading thread
            self._error = e
            if arrivals is not None:
                arrivals.fail(e)

    def _receive(self) -> tuple[None, None]:
        self._group.exchange(self._transfers)
        self._heal()
        return None, None

    def finish(self) -> None:
        """After the load, on every rank: wait for the transfers still under way, then write
        the index of every file received (each data file whole by then). A failure on any
        rank raises on every rank (the transfers' failure before the load's)."""

        def join() -> tuple[None, None]:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
                if self._error is not None:
                    raise self._error
                self._heal()
            return None, None

        run_step(self._group, f"receiving the files of memory step {self.committed.step}", join)

    def _heal(self) -> None:
        for t in self._transfers:
            if not t.send and not t.ranges:  # ranges went into the state, not into a file
                name = index_of(t.path.name)
                self._folder.write_atomic(name, self._indexes[name])


def fetch(
    group: TierGroup, nodes: Nodes, store: MemoryStore, choice: Choice, state: dict[str, Any]
) -> Fetch:
    """Start bringing what this rank's load needs into its node folder (:class:`Fetch`). A
    failure on any rank while planning raises on every rank (a damaged file as
    :class:`CheckpointCorruptError`, so that every rank falls back to storage together)."""
    committed = _commit(group, nodes, store, choice)
    here = nodes.node
    folder = store.step(choice.step)
    path = store.step_path(choice.step)
    extra: dict[str, bytes] = {}
    if here not in choice.commit_nodes:  # served from memory until the leader has written it
        extra[COMMIT_FILE] = committed.commit_raw
        extra[committed.metadata_file] = committed.metadata_raw
    lacking = {r.index for r in committed.refs if here not in choice.holders[r.data]}

    def ask() -> tuple[RankReads | None, list[str]]:
        if here not in choice.commit_nodes and nodes.is_leader:
            write_commit(store, committed)
        if not lacking:
            return None, []
        reads = RankReads(WithIndexes(folder, extra, path), state)
        return reads, sorted(set(reads.index_files()) & lacking)

    planner: RankReads | None = None
    requests: list[list[str]] = []
    everywhere = len(choice.commit_nodes) == nodes.count
    if not everywhere or any(len(h) < nodes.count for h in choice.holders.values()):
        planner, requests = run_step(group, _PLANNING, ask)  # else nothing to plan or ask
    received = _pass_indexes(group, nodes, store, choice, committed, requests)
    extra.update(received)

    def want() -> tuple[dict[str, list[ReadItem]], list[tuple[str, Ranges]]]:
        missing: dict[str, list[ReadItem]] = {}
        if planner is not None:  # else this node holds every file
            for r in planner.plan(WithIndexes(folder, extra, path)):
                if here not in choice.holders[r.file]:
                    missing.setdefault(r.file, []).append(r)
        return missing, [(f, _ranges(reads)) for f, reads in sorted(missing.items())]

    missing, wanted = run_step(group, _PLANNING, want)
    alongside = not _shared_fetches(nodes, wanted)
    transfers = _transfers(nodes, store, choice, committed, wanted, alongside)

    def make_room() -> tuple[Targets | None, None]:
        with folder_errors(f"making room for the files of memory step {choice.step} in {path}"):
            _make_room(store, transfers)
        if not alongside:
            return None, None
        ranged = {t.path.name for t in transfers if t.ranges and not t.send}
        return Targets({path / f: _destinations(missing[f]) for f in ranged}), None

    targets, _ = run_step(group, _PLANNING, make_room)
    files = tuple(sorted([*received, *(t.path.name for t in transfers if not t.send)]))
    fetched = bool(missing)
    return Fetch(
        group, folder, path, committed, extra, transfers, alongside, fetched, files, targets
    )


def _ranges(reads: list[ReadItem]) -> tuple[tuple[int, int], ...]:
    """The byte ranges of a file's chunks when every read of it is a whole chunk into
    contiguous CPU memory (then they can be received straight there), else none."""
    if not all(is_direct(r) and r.chunk.compression is None for r in reads):
        return ()
    spans = sorted({(r.chunk.byte_offset, r.chunk.nbytes) for r in reads})
    disjoint = all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(spans))
    return tuple(spans) if disjoint and len(spans) == len(reads) else ()


def _destinations(reads: list[ReadItem]) -> list[tuple[int, torch.Tensor]]:
    """Each chunk's file offset and the bytes of its destination."""
    return [(r.chunk.byte_offset, byte_view(r.dest).reshape(-1)) for r in reads]


def _commit(group: TierGroup, nodes: Nodes, store: MemoryStore, choice: Choice) -> Committed:
    """The step's commit, from the first node that holds it, on every rank (or, when that
    node cannot read it, the same CheckpointCorruptError on every rank)."""
    source = nodes.leader(choice.commit_nodes[0])
    mine: Committed | str | None = None
    if group.rank == source:
        try:
            mine = read_committed(store, choice.step)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            mine = f"{type(e).__name__}: {e}"
    found = group.broadcast(mine, src=source)
    if not isinstance(found, Committed):
        raise CheckpointCorruptError(
            f"{_PLANNING} failed: rank {source} could not read the commit of memory step "
            f"{choice.step} ({found})"
        )
    return found


def _pass_indexes(
    group: TierGroup,
    nodes: Nodes,
    store: MemoryStore,
    choice: Choice,
    committed: Committed,
    requests: list[list[str]],
) -> dict[str, bytes]:
    """The index files this rank asked for (``requests[rank]``: those its load reads that its
    node lacks), each sent by a rank of the first node holding it (spread over that node's
    ranks); this rank sends those others asked it for. Each rank receives only what it asked
    for, so what moves grows with what each rank loads, not with the world's size."""
    refs = {r.index: r for r in committed.refs}
    passes: list[Pass] = []
    for rank, names in enumerate(requests):
        for name in names:
            ref = refs[name]
            holder = nodes.members[choice.holders[ref.data][0]]
            passes.append(Pass(holder[len(passes) % len(holder)], rank, name, ref.index_nbytes))
    return group.pass_files(store.step_path(choice.step), passes) if passes else {}


def _shared_fetches(nodes: Nodes, wanted: list[list[tuple[str, Ranges]]]) -> bool:
    """Whether a rank reads a file that another rank of its node receives."""
    seen: set[tuple[int, str]] = set()
    for rank, files in enumerate(wanted):
        node = nodes.node_of(rank)
        for f, _ in files:
            if (node, f) in seen:
                return True
            seen.add((node, f))
    return False


def _transfers(
    nodes: Nodes,
    store: MemoryStore,
    choice: Choice,
    committed: Committed,
    wanted: list[list[tuple[str, Ranges]]],
    alongside: bool,
) -> list[Transfer]:
    """Each file a node needs, once: from a holder rank (spread over the holder's ranks) to the
    node's first rank that asked; only the ranges it named when it alone reads the file
    (``alongside``) and named some. The same list on every rank."""
    sizes = {r.data: r.nbytes for r in committed.refs}
    folder = store.step_path(choice.step)
    transfers: list[Transfer] = []
    seen: set[tuple[int, str]] = set()
    tag = 0
    for rank, files in enumerate(wanted):
        node = nodes.node_of(rank)
        for f, ranges in files:
            if (node, f) in seen:
                continue
            seen.add((node, f))
            holder = nodes.members[choice.holders[f][0]]
            src = holder[tag % len(holder)]
            ranges = ranges if alongside else ()
            if nodes.rank == src:
                transfers.append(Transfer(folder / f, sizes[f], rank, tag, True, ranges))
            elif nodes.rank == rank:
                transfers.append(Transfer(folder / f, sizes[f], src, tag, False, ranges))
            tag += 1
    return transfers


def _make_room(store: MemoryStore, transfers: list[Transfer]) -> None:
    """Before files are received whole into the node folder: the folder made, each file's
    index removed (the file counts as present again only once whole), a spare file moved to
    its name (its pages are there already)."""
    for t in transfers:
        if t.send or t.ranges:
            continue
        t.path.parent.mkdir(parents=True, exist_ok=True)
        (t.path.parent / index_of(t.path.name)).unlink(missing_ok=True)
        store.take_spare(t.path, t.nbytes)


class WithIndexes(StorageView):
    """A node's step folder (at ``path``) with the index files (and commit) it lacks that this
    rank reads served from memory; reads of a file still arriving wait for their bytes
    (``arrivals``), and those of a file received into the state (``targets``) are served from
    there."""

    def __init__(
        self,
        base: Storage,
        extra: dict[str, bytes],
        path: Path,
        arrivals: Arrivals | None = None,
        targets: Targets | None = None,
    ) -> None:
        super().__init__(base)
        self.extra = extra
        self.path = path
        self.arrivals = arrivals
        self.targets = targets
        # Files still arriving are read segment by segment, each as soon as it is there: a map
        # of a file's whole span would wait for all of it.
        self.in_memory = base.in_memory and arrivals is None

    @property
    def _arriving(self) -> dict[Path, int]:
        return self.arrivals.sizes if self.arrivals is not None else {}

    def _wait(self, name: str, end: int) -> None:
        if self.arrivals is not None:
            self.arrivals.wait(self.path / name, end)

    def list_names(self) -> list[str]:
        arriving = {p.name for p in self._arriving}
        return sorted(set(self.inner.list_names()) | set(self.extra) | arriving)

    def size(self, name: str) -> int | None:
        raw = self.extra.get(name)
        if raw is not None:
            return len(raw)
        arriving = self._arriving.get(self.path / name)
        return arriving if arriving is not None else self.inner.size(name)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._wait(name, offset + out.nbytes)
        if self.targets is not None and self.path / name in self.targets:
            self.targets.serve(self.path / name, offset, out)
        else:
            self.inner.read_into(name, offset, out)

    def map_range(self, name: str, offset: int, length: int) -> memoryview | None:
        if self.targets is not None and self.path / name in self.targets:
            return None  # no file: its bytes go straight into the state
        self._wait(name, offset + length)
        return self.inner.map_range(name, offset, length)

    def read_bytes(self, name: str) -> bytes | None:
        raw = self.extra.get(name)
        if raw is not None:
            return raw
        size = self.size(name)
        self._wait(name, size or 0)
        return self.inner.read_bytes(name)
