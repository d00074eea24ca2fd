"""Which save goes where, what a restart reads first: a Checkpointer with a memory tier.

Every save lands in the nodes' memory (:mod:`.memory`), then, in the save's background
thread, its commit goes to every node and each rank's files to its replica node
(:mod:`.replicate`); ``fut.wait()`` returns once both are done. Every ``persist_every``-th save
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import api
from ..engine.futures import SaveFuture
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..storage.base import Storage
from .group import TierGroup
from .memory import MemoryStore, MemoryTier, job_name
from .nodes import Nodes, node_name
from .persist import persist
from .replicate import Committed, replicate, share_commit
from .restore import choose, fetch, survey

if TYPE_CHECKING:
    from ..checkpointer import Checkpointer

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
    """Counts of this rank's memory tier since the Checkpointer was made."""

    saves: int = 0
    persists: int = 0
    persist_waits: int = 0
    persist_wait_s: float = 0.0
    replica_bytes: int = 0


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

        # Not a daemon: an interpreter that exits finishes the persist first.
        self.thread = threading.Thread(target=run, name="unickpt-persist", daemon=False)
        self.thread.start()

    def join(self, timeout_s: float | None = None) -> bool:
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


class TierPolicy:
    """The memory tier of one Checkpointer (made on its first save or load, collectively)."""

    def __init__(self, ckpt: Checkpointer, tier: MemoryTier) -> None:
        self.ckpt = ckpt
        self.tier = tier
        self.store = MemoryStore(tier.folder, job_name(ckpt.storage.location))
        self.stats = MemoryStats()
        self.newest: Committed | None = None
        self._group: TierGroup | None = None
        self._nodes: Nodes | None = None
        self._persist: _Persist | None = None
        self._since_persist = 0
        self._lock = threading.Lock()

    # -- setup ---------------------------------------------------------------------------

    def _setup(self) -> tuple[TierGroup, Nodes]:
        if self._group is None or self._nodes is None:
            group = TierGroup(self.ckpt.group, self.ckpt.config.collective_timeout_s)
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

    def save(self, step: int, state: dict[str, Any]) -> SaveFuture:
        group, nodes = self._setup()
        self._make_room()
        group.barrier()  # every rank's persist of a retiring step is over
        if nodes.is_leader:
            keep = {self.newest.step} if self.newest is not None else set()
            for gone in self.store.retire(keep):
                log.debug("retired memory step %d", gone)
        self._count(saves=1)
        self._since_persist += 1
        due = self._since_persist >= self.tier.persist_every
        if due:
            self._since_persist = 0
        target = self.store.step_storage(step)

        def committed() -> None:
            self._after_commit(step, due)

        ckpt = self.ckpt
        if not ckpt.async_save:
            report = api.save(
                target,
                state,
                group=ckpt.group,
                overwrite=True,
                config=ckpt.config,
                quantize=ckpt.quantize,
            )
            committed()
            return SaveFuture.completed(report)
        return api.async_save(
            target,
            state,
            group=ckpt.group,
            overwrite=True,
            background_snapshot=ckpt.background_snapshot,
            config=ckpt.config,
            on_commit=committed,
            quantize=ckpt.quantize,
        )

    def _make_room(self) -> None:
        """Before a save: wait for a persist of the checkpoint the save retires."""
        running = self._persist
        if running is not None and (self.newest is None or running.step != self.newest.step):
            self._finish_persist("the save would delete the memory checkpoint it reads")
        elif running is not None and not running.thread.is_alive():
            self._finish_persist("")

    def _finish_persist(self, why: str) -> None:
        """Wait for the running persist (counted and warned when it is not over); raise its
        failure."""
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
            raise CheckpointError(
                f"persisting memory step {running.step} to {self.ckpt.root} failed: "
                f"{running.error}. The memory checkpoints are intact; fix the storage."
            ) from running.error

    def _after_commit(self, step: int, due: bool) -> None:
        """In the save's thread, on every rank: commit copies, replicas, then the persist."""
        group, nodes = self._setup()
        committed = share_commit(group, nodes, self.store, step)
        if self.tier.replicas > 1 and nodes.count > 1:
            sent = replicate(group, nodes, self.store, committed, self.tier.replicas)
            self._count(replica_bytes=sent)
        self.newest = committed
        if due:
            self._start_persist(committed)

    def _start_persist(self, committed: Committed) -> None:
        self._finish_persist("one persist runs at a time")
        rank = self._group.rank if self._group else 0

        def work() -> None:
            if persist(
                self.store, committed, self.ckpt.storage, [rank], self.ckpt.config.io_threads
            ):
                self.ckpt._retain(committed.step, any_rank=True)
            self._count(persists=1)

        self._persist = _Persist(committed.step, work)

    # -- restore -------------------------------------------------------------------------

    def load_latest(
        self, state: dict[str, Any], strict: bool, from_storage: Callable[[], int | None]
    ) -> tuple[int | None, RestoreInfo]:
        t0 = time.perf_counter()
        group, nodes = self._setup()
        held, newest_stored = survey(group, nodes, self.store, self.ckpt.steps)
        choice = choose(held)
        if choice is not None and (newest_stored is None or choice.step >= newest_stored):
            try:
                fetching = fetch(group, nodes, self.store, choice, state)
                try:
                    api.load(
                        fetching.view,
                        state,
                        group=self.ckpt.group,
                        strict=strict,
                        config=self.ckpt.config,
                    )
                finally:
                    fetching.finish()  # the transfers' failure first, else the load's
                self.newest = fetching.committed
                source = "peer" if fetching.fetched else "memory"
                seconds = time.perf_counter() - t0
                info = RestoreInfo(choice.step, source, seconds, fetching.received)
                return choice.step, info
            except (CheckpointCorruptError, CheckpointNotFoundError) as e:
                warnings.warn(
                    f"memory checkpoint of step {choice.step} cannot be loaded ({e}); loading "
                    "from storage instead.",
                    stacklevel=3,
                )
        step = from_storage()
        source = "storage" if step is not None else "none"
        return step, RestoreInfo(step, source, time.perf_counter() - t0)

    # -- the end -------------------------------------------------------------------------

    def close(self) -> None:
        """Persist the newest memory checkpoint unless storage has it; free the job's memory.

        Collective. When storage does not end up with the checkpoint, raises on every rank and
        leaves the memory checkpoints where they are (a restart still finds them).
        """
        if self._group is None or self._nodes is None:
            return
        group, nodes = self._group, self._nodes
        running, self._persist = self._persist, None
        failure: BaseException | None = None
        if running is not None:
            running.join()
            failure = running.error
        newest, done = self.newest, True
        if newest is not None and failure is None:
            try:
                done = persist(self.store, newest, self.ckpt.storage, self._mine(newest))
            except Exception as e:  # noqa: BLE001 - every rank learns of it below
                failure = e
        outcomes = group.all_gather((None if failure is None else str(failure), done))
        errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(outcomes) if e is not None]
        if not errors and not any(d for _, d in outcomes):
            errors = [f"no rank saw all files of step {newest and newest.step} in storage"]
        if errors:
            raise CheckpointError(
                f"closing the memory tier: persisting to {self.ckpt.root} failed "
                f"({'; '.join(errors)}); the memory checkpoints stay in {self.store.root}, "
                "where a restart finds them."
            ) from failure
        if newest is not None and group.rank == 0:
            self.ckpt._retain(newest.step, any_rank=True)
        if nodes.is_leader:
            self.store.clear()

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
        pending = self.ckpt._pending
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.wait(max(0.0, deadline - time.monotonic()))
        running = self._persist
        if running is not None:
            running.join(max(0.0, deadline - time.monotonic()))
        newest, group, nodes = self.newest, self._group, self._nodes
        if newest is None or group is None or nodes is None:
            return
        kept = [s for s, d in nodes.sends(self.tier.replicas) if d == group.rank]
        ranks = [*self._mine(newest), *kept]
        outcome: list[str] = []

        def work() -> None:
            try:
                done = persist(self.store, newest, self.ckpt.storage, ranks)
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
            self.ckpt.root,
            result,
        )


def _is_persisted(root: Storage, committed: Committed) -> bool:
    from .persist import persisted

    return persisted(root, committed)
