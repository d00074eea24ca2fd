"""Which save goes where, what a restart reads first: a Checkpointer with a memory tier.

Every save lands in the nodes' memory (:mod:`.memory`), then, in the save's background
thread, its commit goes to every node and each rank's files to its replica node
(:mod:`.replicate`); ``fut.wait()`` returns once both are done, every replica whole on its
node (its receiver renamed it into place and said so to every rank). Every ``persist_every``-th save
is then copied to storage in a thread of its own (:mod:`.persist`), overlapping the next save.

Bounded memory, and the rule when a persist is still running: a node keeps the newest
committed memory checkpoint and the one being written, nothing else, and one persist runs at a
time. A persist overlaps the saves that follow until either a save would retire (delete) the
checkpoint it reads, or the next persist is due: then that save, or the next persist (in the
save's background, so ``fut.wait()``), waits for it. Every wait is counted
(:class:`MemoryStats`) and warned about; no save and no persist is ever dropped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .. import api
from ..config import Config
from ..dist import node_name, run_step
from ..engine.futures import SaveFuture
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..layouts.rules import LayoutMap
from ..root import Root, RootIdentity
from ..storage.base import Storage
from .group import TierGroup
from .memory import MemoryStore, MemoryTier, folder_errors
from .nodes import Nodes
from .persist import persist
from .replicate import Committed, replicate, share_commit
from .restore import choose, fetch, survey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreInfo:
    """Where this rank's last ``load_latest`` came from, and how long it took until the state
    held the values. ``source`` is "memory", "peer" or "storage" ("none" when nothing was
    found). ``peer_files``: the index and data files this rank received from other nodes (a
    data file's chunks received straight into the state count as that file), sorted."""

    step: int | None
    source: str
    seconds: float
    peer_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class MemoryStats:
    """Counts of this rank's memory tier since the Checkpointer was made.

    ``persist_failures``: persists to storage that failed (each warned about; the memory
    checkpoints stay, later persists and the one at ``close`` go on)."""

    saves: int = 0
    persists: int = 0
    persist_waits: int = 0
    persist_wait_s: float = 0.0
    replica_bytes: int = 0
    persist_failures: int = 0


@dataclass(frozen=True)
class SaveSettings:
    """What the tier needs of the Checkpointer (it never sees the Checkpointer)."""

    group: Any
    config: Config
    keep_last: int | None
    layout: LayoutMap | None = None


_RUNNING: set[_Persist] = set()  # every persist under way in this process
_RUNNING_LOCK = threading.Lock()


def wait_persists(timeout_s: float) -> bool:
    """Wait for the persists under way in this process (those of a Checkpointer of an earlier
    membership of the job too: a new one would take their folders in storage for debris);
    whether they all ended within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    return all(p.join(max(0.0, deadline - time.monotonic())) for p in running)


class _Persist:
    """One background persist: its step and thread."""

    def __init__(self, step: int, work: Callable[[], None]) -> None:
        self.step = step
        self.error: BaseException | None = None

        def run() -> None:
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - reported at the next save or close
                self.error = e
            finally:
                with _RUNNING_LOCK:
                    _RUNNING.discard(self)

        # Not a daemon: an interpreter that exits finishes the persist first.
        self.thread = threading.Thread(target=run, name="unickpt-persist", daemon=False)
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        self.thread.start()

    def join(self, timeout_s: float | None = None) -> bool:
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


class TierPolicy:
    """The memory tier of one Checkpointer's root (made on its first save or load,
    collectively)."""

    def __init__(self, root: Root, tier: MemoryTier, settings: SaveSettings) -> None:
        self.root = root
        self.tier = tier
        self.settings = settings
        self.store: MemoryStore | None = None
        self.stats = MemoryStats()
        self.newest: Committed | None = None
        self.pending: SaveFuture | None = None
        self._group: TierGroup | None = None
        self._nodes: Nodes | None = None
        self._persist: _Persist | None = None
        self._since_persist = 0
        self._lock = threading.Lock()

    def bind(self, identity: RootIdentity) -> None:
        """Use the memory checkpoints of the root with this identity (and no other's)."""
        if self.store is None or self.store.identity != identity:
            self.store = MemoryStore(self.tier.folder, identity)

    def _bound(self) -> MemoryStore:
        if self.store is None:
            raise AssertionError("the memory tier is bound to its root's identity before a save")
        return self.store

    # -- setup ---------------------------------------------------------------------------

    def _setup(self) -> tuple[TierGroup, Nodes]:
        if self._group is None or self._nodes is None:
            group = TierGroup(self.settings.group, self.settings.config.collective_timeout_s)
            nodes = Nodes.from_names(group.rank, group.all_gather(node_name()))
            if self.tier.replicas > 1 and nodes.count == 1 and group.rank == 0:
                log.warning(
                    "replicas=%d needs at least 2 nodes, and this job runs on one: memory "
                    "checkpoints are kept in this node's memory only",
                    self.tier.replicas,
                )
            self._group, self._nodes = group, nodes
        return self._group, self._nodes

    def _count(self, **more: float) -> None:
        with self._lock:
            values = {k: getattr(self.stats, k) + v for k, v in more.items()}
            self.stats = MemoryStats(**{**self.stats.__dict__, **values})

    # -- save ----------------------------------------------------------------------------

    def begin_save(self, step: int) -> tuple[Storage, Callable[[], None]]:
        """Before the save of ``step`` (collective): room made for it; the memory folder it is
        saved to and what runs once it is committed, in the save's thread, on every rank
        (commit copies, replicas, then the persist when one is due). The Checkpointer then
        saves there and hands the save's future to :attr:`pending`."""
        group, nodes = self._setup()
        store = self._bound()
        self._make_room()
        group.barrier()  # every rank's persist of a retiring step is over
        what = f"preparing the memory folders for step {step}"
        run_step(group, what, lambda: self._prepare_folder(nodes, store))
        self._count(saves=1)
        self._since_persist += 1
        due = self._since_persist >= self.tier.persist_every
        if due:
            self._since_persist = 0
        return store.step_storage(step), lambda: self._after_commit(step, due)

    def _prepare_folder(self, nodes: Nodes, store: MemoryStore) -> tuple[None, None]:
        """On each node's leader: claim the job's folder and retire older steps. Run as a step
        of every rank (its outcome reaches all of them before the save's collectives)."""
        if not nodes.is_leader:
            return None, None
        keep = {self.newest.step} if self.newest is not None else set()
        with folder_errors(f"preparing the memory folder {store.root}"):
            store.claim()
            for gone in store.retire(keep):
                log.debug("retired memory step %d", gone)
        return None, None

    def _make_room(self) -> None:
        """Before a save: wait for a persist of the checkpoint the save retires."""
        running = self._persist
        if running is not None and (self.newest is None or running.step != self.newest.step):
            self._finish_persist("the save would delete the memory checkpoint it reads")
        elif running is not None and not running.thread.is_alive():
            self._finish_persist("")

    def _finish_persist(self, why: str) -> None:
        """Wait for the running persist (counted and warned when it is not over). Its
        failure is warned about and counted, never raised into a save: the memory
        checkpoints are intact, and later persists (and the one at ``close``) go on."""
        running, self._persist = self._persist, None
        if running is None:
            return
        if running.thread.is_alive():
            t0 = time.perf_counter()
            warnings.warn(
                f"memory tier: waiting for the persist of step {running.step} to storage: {why}."
                " Persist less often (persist_every) or to faster storage to avoid the wait.",
                stacklevel=4,
            )
            running.join()
            self._count(persist_waits=1, persist_wait_s=time.perf_counter() - t0)
        if running.error is not None:
            self._count(persist_failures=1)
            warnings.warn(
                f"memory tier: persisting memory step {running.step} to {self.root.location} "
                f"failed ({running.error}). The memory checkpoints are intact and later "
                "persists go on; fix the storage, or the checkpoints will exist in memory only.",
                stacklevel=4,
            )

    def _after_commit(self, step: int, due: bool) -> None:
        """In the save's thread, on every rank: commit copies, replicas, then the persist."""
        group, nodes = self._setup()
        store = self._bound()
        committed = share_commit(group, nodes, store, step)
        if self.tier.replicas > 1 and nodes.count > 1:
            sent = replicate(group, nodes, store, committed, self.tier.replicas)
            self._count(replica_bytes=sent)
        self.newest = committed
        if due:
            self._start_persist(committed)

    def _start_persist(self, committed: Committed) -> None:
        self._finish_persist("one persist runs at a time")
        rank = self._group.rank if self._group else 0
        store, root = self._bound(), self.root
        threads = self.settings.config.io_threads

        def work() -> None:
            if persist(store, committed, root.storage, [rank], threads):
                # Whoever sees the checkpoint committed in storage retires older steps there.
                root.retain(committed.step, self.settings.keep_last)
            self._count(persists=1)

        self._persist = _Persist(committed.step, work)

    # -- restore -------------------------------------------------------------------------

    def load_latest(
        self,
        state: dict[str, Any],
        strict: bool,
        from_storage: Callable[[dict[str, str]], int | None],
    ) -> tuple[int | None, RestoreInfo]:
        """The newest step in memory, peers' memory or storage, loaded into ``state``.
        ``from_storage(failed)`` loads from storage, reporting ``failed`` (memory sources that
        did not load) with its own failures when nothing loads."""
        t0 = time.perf_counter()
        group, nodes = self._setup()
        held, newest_stored = survey(group, nodes, self.store, self.root.list_committed)
        choice = choose(held)
        failed: dict[str, str] = {}
        newest_in_memory = choice is not None and (
            newest_stored is None or choice.step >= newest_stored
        )
        if self.store is not None and choice is not None and newest_in_memory:
            try:
                fetching = fetch(group, nodes, self.store, choice, state)
                try:
                    api.load(
                        fetching.view,
                        state,
                        group=self.settings.group,
                        strict=strict,
                        # each node reads its own copy: nothing to share across nodes
                        config=replace(self.settings.config, share_across_nodes=False),
                        layout=self.settings.layout,
                    )
                finally:
                    fetching.finish()  # the transfers' failure first, else the load's
                self.newest = fetching.committed
                source = "peer" if fetching.fetched else "memory"
                seconds = time.perf_counter() - t0
                info = RestoreInfo(choice.step, source, seconds, fetching.received)
                return choice.step, info
            except (CheckpointCorruptError, CheckpointNotFoundError) as e:
                failed[f"memory step {choice.step} ({self.store.root})"] = str(e)
                warnings.warn(
                    f"memory checkpoint of step {choice.step} cannot be loaded ({e}); "
                    "loading from storage instead.",
                    stacklevel=3,
                )
        step = from_storage(failed)
        source = "storage" if step is not None else "none"
        return step, RestoreInfo(step, source, time.perf_counter() - t0)

    # -- the end -------------------------------------------------------------------------

    def close(self) -> None:
        """Persist the newest memory checkpoint unless storage has it; free the job's memory.

        Collective. When storage does not end up with the checkpoint, raises on every rank and
        leaves the memory checkpoints where they are (a restart still finds them). A persist
        of an earlier step that failed does not stop the last one.
        """
        if self._group is None or self._nodes is None or self.store is None:
            return
        group, nodes, store = self._group, self._nodes, self.store
        running, self._persist = self._persist, None
        if running is not None:
            running.join()
        failure: BaseException | None = None
        newest, done = self.newest, True
        if newest is not None:
            try:
                done = persist(store, newest, self.root.storage, self._mine(newest))
            except Exception as e:  # noqa: BLE001 - every rank learns of it below
                failure = e
        outcomes = group.all_gather((None if failure is None else str(failure), done))
        errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(outcomes) if e is not None]
        if not errors and not any(d for _, d in outcomes):
            errors = [f"no rank saw all files of step {newest and newest.step} in storage"]
        if errors:
            raise CheckpointError(
                f"closing the memory tier: persisting to {self.root.location} failed "
                f"({'; '.join(errors)}); the memory checkpoints stay in {store.root}, "
                "where a restart finds them."
            ) from failure
        if newest is not None and group.rank == 0:
            self.root.retain(newest.step, self.settings.keep_last)
        if nodes.is_leader:
            store.clear()

    def _mine(self, committed: Committed) -> list[int]:
        """The writers whose files this rank persists: its own; after a restart on fewer
        ranks, also those of missing ranks ``r`` with ``r % size == rank``."""
        assert self._group is not None
        size, rank = self._group.world_size, self._group.rank
        return [r for r in committed.writers if r == rank or (r >= size and r % size == rank)]

    def save_on_the_way_down(self) -> None:
        """Persist the newest memory checkpoint before the process ends, with no collective,
        within ``persist_deadline_s``: this rank's files and the replicas it keeps."""
        deadline = time.monotonic() + self.tier.persist_deadline_s
        pending = self.pending
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.wait(max(0.0, deadline - time.monotonic()))
        running = self._persist
        if running is not None:
            running.join(max(0.0, deadline - time.monotonic()))
        newest, group, nodes, store = self.newest, self._group, self._nodes, self.store
        if newest is None or group is None or nodes is None or store is None:
            return
        kept = [s for s, d in nodes.sends(self.tier.replicas) if d == group.rank]
        ranks = [*self._mine(newest), *kept]
        outcome: list[str] = []

        def work() -> None:
            try:
                done = persist(store, newest, self.root.storage, ranks)
                outcome.append("committed" if done else "uploaded")
            except BaseException as e:  # noqa: BLE001 - logged: the process is ending anyway
                outcome.append(f"failed: {e}")

        thread = threading.Thread(target=work, name="unickpt-last-persist", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        result = outcome[0] if outcome else f"cut off after {self.tier.persist_deadline_s} s"
        log.warning(
            "rank %d on the way down: memory step %d to %s: %s",
            group.rank,
            newest.step,
            self.root.location,
            result,
        )
