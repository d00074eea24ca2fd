"""Checkpointer: numbered checkpoints under one root, for training loops.

One folder per step (``step-000000100``), counted only once committed; the newest intact one
is found on restart, damaged ones are skipped with a warning; old ones are deleted only after
a newer one is committed; folders left by an interrupted save are removed by a later save.
The root is any path or URL a storage backend serves; listing, deleting and locking go
through that backend.
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import api
from .config import Config, get_config
from .dist import Comm, dedicated_comm, run_step
from .encoding.saving import check_quantize
from .engine.commit import read_checkpoint
from .engine.futures import SaveFuture
from .engine.incremental import Basis
from .engine.references import needed_steps
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)
from .format.metadata import COMMIT_FILE
from .storage.base import Storage
from .storage.registry import open_storage
from .tuning import IntervalTuner, Tuning
from .tuning.restarts import mtbf_from_starts, record_start

if TYPE_CHECKING:
    from .tiers.memory import MemoryTier
    from .tiers.policy import MemoryStats, RestoreInfo

log = logging.getLogger(__name__)

_STEP = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    """The folder name of ``step`` under a Checkpointer root."""
    return f"step-{step:09d}"


def step_folders(root: Storage) -> dict[int, str]:
    """Every step folder under ``root`` (committed or not), by step."""
    found = {}
    for name in root.list_names():
        m = _STEP.match(name)
        if m:
            found[int(m.group(1))] = name
    return found


def committed_steps(root: Storage) -> list[int]:
    """Steps whose folder holds a commit marker, ascending (folders without one are ignored)."""
    return sorted(
        s
        for s, name in step_folders(root).items()
        if root.child(name).size(COMMIT_FILE) is not None
    )


def open_checkpoint(location: str | os.PathLike[str] | Storage, step: int | None = None) -> Storage:
    """The checkpoint at ``location``; for a Checkpointer root, its newest committed step, or
    ``step`` when given.

    >>> reader = CheckpointReader(open_checkpoint("runs/gpt"))  # doctest: +SKIP
    """
    storage = open_storage(location)
    is_checkpoint = storage.size(COMMIT_FILE) is not None
    if step is None and is_checkpoint:
        return storage
    if step is not None and is_checkpoint:
        raise CheckpointError(
            f"{storage.location} is a checkpoint, not a Checkpointer root (a folder of step-N "
            "folders); a step applies to roots. Leave out the step or pass the root."
        )
    folders = step_folders(storage)
    if step is None and not folders:
        return storage  # not a root either: loading it says what is there
    committed = committed_steps(storage)
    if step is None and not committed:
        raise CheckpointNotFoundError(
            f"{storage.location} is a Checkpointer root whose {len(folders)} step folder(s) hold "
            "no committed checkpoint: the saves that wrote them did not finish."
        )
    if step is not None and step not in committed:
        listed = ", ".join(map(str, committed[-10:])) or "none"
        raise CheckpointNotFoundError(
            f"step {step} is not a committed checkpoint of {storage.location}; its committed "
            f"steps are: {listed}. Pass one of them."
        )
    return storage.child(step_name(committed[-1] if step is None else step))


class Checkpointer:
    """Save every few steps, resume from the newest intact checkpoint.

    >>> ckpt = unickpt.Checkpointer("runs/gpt", keep_last=3)  # doctest: +SKIP
    >>> last = ckpt.load_latest(state)  # doctest: +SKIP
    >>> start = 0 if last is None else last + 1  # doctest: +SKIP
    >>> for step in range(start, steps):  # doctest: +SKIP
    ...     train_step()
    ...     if step % 100 == 0:
    ...         ckpt.save(step, state)
    >>> ckpt.close()  # doctest: +SKIP

    The checkpoint of step N holds the state after step N: a resumed loop goes on with N + 1.

    All ranks of ``group`` construct it and call ``save``/``load_latest`` together. ``root`` is
    a path or URL (``s3://bucket/run``, ``memory://run``, ...) or a :class:`Storage`. A
    Checkpointer that saves is a writer: its first ``save`` takes the root's lock (held until
    ``close``), so two jobs cannot write into one root; one that only lists and loads (an
    evaluation job beside training) never locks and works beside the writer.

    With ``memory=MemoryTier(...)`` saves land in the nodes' memory (and their replicas in
    other nodes' memory), every ``persist_every``-th one also in ``root``; ``load_latest``
    reads the newest step complete in memory, peers' memory or storage; see
    docs/memory_tier.md.

    With ``incremental=True`` a save writes only the chunks whose bytes changed since this
    Checkpointer's previous save and refers to the earlier checkpoints' bytes for the others
    (format version 2): frozen layers of a fine-tune, a frozen base under LoRA adapters, tables
    left untouched cost nothing. Every ``full_every``-th save is full; a Checkpointer's first
    save refers to the newest committed checkpoint of the root (a restarted job's chain goes
    on), except for tables compared row by row, written whole once. Worth it when much of the
    state stays the same between saves; in full training, where every tensor changes, it only
    adds hashing before the write. Retention keeps every step that a kept checkpoint refers to
    (``steps()`` lists them; they are deleted once no kept checkpoint refers to them).
    ``row_deltas`` takes patterns of keys (``fnmatch``, e.g. ``["model.tables.*",
    "optim.state.tables.*"]``) of embedding tables: of those, only the rows that changed are
    written.

    With ``every`` (a number of steps, or ``"auto"``) the loop calls :meth:`maybe_save` every
    step and the Checkpointer decides when to save: ``"auto"`` measures the step time and what
    each save costs the loop, and saves as often as keeps that cost within ``max_overhead`` of
    the loop's time, or, with a mean time between failures (``mtbf_s``, or learnt from the
    restarts recorded at the root), at the Young/Daly interval, never more often than that
    bound allows. :attr:`tuning` says what it measured and why it chose its interval.
    ``quantize`` (table key -> 8 or 4 bits) stores those tables quantized per row in every
    save (see :func:`unickpt.save`).

    >>> ckpt = unickpt.Checkpointer("runs/gpt", every="auto", max_overhead=0.01)  # doctest: +SKIP
    >>> for step in range(start, steps):  # doctest: +SKIP
    ...     train_step()
    ...     ckpt.maybe_save(step, state)
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        *,
        keep_last: int | None = None,
        group: Any = None,
        async_save: bool = True,
        background_snapshot: bool = False,
        config: Config | None = None,
        memory: MemoryTier | None = None,
        incremental: bool = False,
        full_every: int = 8,
        row_deltas: Sequence[str] = (),
        every: int | str | None = None,
        max_overhead: float = 0.01,
        mtbf_s: float | None = None,
        quantize: Mapping[str, int] | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last is {keep_last}; expected None or at least 1.")
        if full_every < 1:
            raise CheckpointError(f"full_every is {full_every}; expected at least 1.")
        if row_deltas and not incremental:
            raise CheckpointError("row_deltas needs incremental=True; pass both.")
        if incremental and memory is not None:
            raise CheckpointError(
                "incremental=True and a memory tier were both given; incremental saves are "
                "for checkpoints written straight to storage. Pass one of them."
            )
        self.storage = open_storage(root)
        self.keep_last = keep_last
        self.group = group
        self.async_save = async_save
        self.background_snapshot = background_snapshot
        self.config = config or get_config()
        self._comm = Comm(group, self.config.collective_timeout_s)
        self._pending: SaveFuture | None = None
        self._release: Callable[[], None] | None = None
        # -- memory tier (unickpt.tiers): the policy lives there, delegated to from here --
        self.last_restore: RestoreInfo | None = None
        self._tier = None
        if memory is not None:
            from .tiers.policy import TierPolicy

            self._tier = TierPolicy(self, memory)
        self._basis = Basis(full_every, row_deltas) if incremental else None
        # -- interval tuner (unickpt.tuning): maybe_save decides when to save --
        self._tuner: IntervalTuner | None = None
        if every is not None:
            self._tuner = IntervalTuner(every, max_overhead, mtbf_s, agree=self._agree_interval)
            # Its collectives run while saves write in the background: a group of their own.
            self._tuner_comm = dedicated_comm(group, self.config.collective_timeout_s)
        self._started = False
        self.quantize = check_quantize(quantize)

    @property
    def memory_stats(self) -> MemoryStats | None:
        """Counts of the memory tier on this rank (saves, persists, waits); None without one."""
        return self._tier.stats if self._tier is not None else None

    def guard(self) -> Any:
        """``with ckpt.guard():`` around the training loop: on SIGTERM, SIGINT or an exception,
        persist the newest memory checkpoint (within ``persist_deadline_s``), then end as the
        process would have. Without a memory tier it completes the pending save."""
        from .tiers.guard import guard

        down = self._tier.save_on_the_way_down if self._tier is not None else self.wait
        return guard(down)

    @property
    def root(self) -> str:
        """Where the step folders are (a path or URL)."""
        return self.storage.location

    def path(self, step: int) -> str:
        """The location of ``step``'s folder (a path or URL that ``unickpt.load`` takes)."""
        return self._step(step).location

    def _step(self, step: int) -> Storage:
        return self.storage.child(step_name(step))

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return committed_steps(self.storage)

    def save(self, step: int, state: dict[str, Any]) -> SaveFuture:
        """Save ``state`` as ``step``: asynchronous unless ``async_save=False``.

        The first save locks the root (:class:`~unickpt.errors.CheckpointLockedError` when
        another job writes into it) and removes folders left by interrupted saves.
        """
        self.wait()
        if step < 0:
            raise CheckpointError(f"step is {step}; expected a non-negative integer.")
        first = self._release is None
        if first:
            self._lock()
        if self._comm.is_coordinator and (first or self._tier is None):
            self._remove_debris(keep=step)  # with a memory tier, persists may be under way
        if self._tier is not None:
            self._pending = self._tier.save(step, state)
            return self._pending
        self._refuse_overwriting_a_base(step)
        target = self._step(step)
        inc = None
        if self._basis is not None:
            if first:
                self._seed_basis(self._basis, step)
            inc = self._basis.next_save(step_name(step), self.config.segment_bytes, self._committed)
        if not self.async_save:
            report = api.save(
                target,
                state,
                group=self.group,
                overwrite=True,
                config=self.config,
                incremental=inc,
                quantize=self.quantize,
            )
            self._retain(step)
            return SaveFuture.completed(report)
        self._pending = api.async_save(
            target,
            state,
            group=self.group,
            overwrite=True,
            background_snapshot=self.background_snapshot,
            config=self.config,
            on_commit=lambda: self._retain(step),
            incremental=inc,
            quantize=self.quantize,
        )
        return self._pending

    def _seed_basis(self, basis: Basis, step: int) -> None:
        """This rank's first incremental save: start from the newest committed step before
        ``step`` (a restarted job), so the save refers to its unchanged chunks. A checkpoint
        that does not read leaves the save full."""
        older = [s for s in self.steps() if s < step]
        if not older:
            return
        try:
            _, meta = read_checkpoint(self._step(older[-1]))
        except CheckpointError as e:
            log.info(
                "incremental save of step %d is full: step %d does not read (%s)",
                step,
                older[-1],
                e,
            )
            return
        basis.seed(step_name(older[-1]), meta)

    def _committed(self, name: str) -> bool:
        return self.storage.child(name).size(COMMIT_FILE) is not None

    def maybe_save(self, step: int, state: dict[str, Any]) -> SaveFuture | None:
        """Called every step (on every rank): save ``state`` as ``step`` when the interval
        (``every``) says so; the save's future, or None."""
        tuner = self._tuner
        if tuner is None:
            raise CheckpointError(
                "maybe_save needs an interval; construct the Checkpointer with every=N (steps) "
                "or every='auto', or call save() at the steps you choose."
            )
        if not self._started:
            self._started = True
            tuner.learn_mtbf(self._tuner_comm.broadcast(self._learn_mtbf()))
        if not tuner.begin(step):
            tuner.end(step, saved=False)
            return None
        future = self.save(step, state)
        tuner.end(step, saved=True, done=future.done if self.async_save else None)
        return future

    @property
    def tuning(self) -> Tuning | None:
        """What the interval tuner measured and chose (None without ``every``)."""
        return None if self._tuner is None else self._tuner.tuning

    def _learn_mtbf(self) -> float | None:
        """Record this start at the root (coordinator); the MTBF the starts imply."""
        if not self._comm.is_coordinator:
            return None
        now = time.time()
        return mtbf_from_starts(record_start(self.storage, now), now)

    def _agree_interval(self, every: int) -> int:
        """Every rank saves at the same steps: the longest interval any rank proposes."""
        return max(self._tuner_comm.all_gather(every))

    def _lock(self) -> None:
        """Take the root's writer lock on the coordinator; every rank learns the outcome."""

        def lock() -> tuple[Callable[[], None], None]:
            return (self.storage.acquire_lock() if self._comm.is_coordinator else _no_op), None

        self._release, _ = run_step(self._comm, "locking the checkpoint root", lock)

    def load_latest(self, state: dict[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest intact checkpoint into ``state``; its step, or None when none."""
        self.wait()
        if self._tier is not None:
            step, self.last_restore = self._tier.load_latest(
                state, strict, lambda: self._load_stored(state, strict)
            )
            return step
        return self._load_stored(state, strict)

    def _load_stored(self, state: dict[str, Any], strict: bool) -> int | None:
        steps = self._comm.broadcast(self.steps())
        for step in reversed(steps):
            try:
                api.load(
                    self._step(step), state, group=self.group, strict=strict, config=self.config
                )
                return step
            except (CheckpointCorruptError, CheckpointNotFoundError) as e:
                warnings.warn(
                    f"checkpoint of step {step} at {self.path(step)} cannot be loaded ({e}); "
                    "falling back to the one before.",
                    stacklevel=2,
                )
        return None

    def wait(self) -> None:
        """Wait for the pending asynchronous save; re-raise its failure."""
        pending = self._pending
        try:
            if pending is not None and not (pending.done() and pending.error_reported):
                pending.wait()
        finally:  # cleared once over: a signal handler run in the wait still sees it
            self._pending = None

    def close(self) -> None:
        """Wait for pending saves and release the root; with a memory tier, persist what
        storage lacks and free the job's memory."""
        try:
            self.wait()
            if self._tier is not None:
                self._tier.close()
        finally:
            if self._release is not None:
                self._release()
                self._release = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _refuse_overwriting_a_base(self, step: int) -> None:
        """Saving again over a committed step that other steps' incremental checkpoints refer to
        would change the bytes they stand on: refused on every rank, before anything is written."""
        message = None
        if self._comm.is_coordinator:
            committed = self.steps()
            if step in committed:
                name = step_name(step)
                dependents = [
                    s
                    for s in committed
                    if s != step and name in needed_steps(self.storage, [step_name(s)])
                ]
                if dependents:
                    message = (
                        f"step {step} is already saved in {self.storage.location} and the "
                        f"incremental checkpoints of step(s) {', '.join(map(str, dependents))} "
                        "refer to its bytes; saving over it would break them. Save under a new "
                        "step number, or delete those steps first."
                    )
        message = self._comm.broadcast(message)
        if message is not None:
            raise CheckpointError(message)

    def _retain(self, newest: int, any_rank: bool = False) -> None:
        if self.keep_last is None or not (any_rank or self._comm.is_coordinator):
            return
        committed = self.steps()
        older = [s for s in committed if s < newest]
        doomed = older[: max(0, len(older) - (self.keep_last - 1))]
        if doomed:  # steps a kept checkpoint refers to stay
            needed = needed_steps(
                self.storage, [step_name(s) for s in committed if s not in doomed]
            )
            doomed = [s for s in doomed if step_name(s) not in needed]
        for step in doomed:
            self._delete(step_name(step), uncommit=True)

    def _remove_debris(self, keep: int) -> None:
        for step, name in step_folders(self.storage).items():
            if step != keep and self.storage.child(name).size(COMMIT_FILE) is None:
                log.info("removing %s, left by an interrupted save", self._step(step).location)
                self._delete(name, uncommit=False)

    def _delete(self, name: str, uncommit: bool) -> None:
        """Uncommit first, so a crash midway leaves debris, never a half-deleted checkpoint."""
        try:
            if uncommit:
                self.storage.child(name).remove(COMMIT_FILE)
            self.storage.remove_tree(name)
        except CheckpointError as e:
            log.warning("could not delete %s (%s); delete it by hand", name, e)


def _no_op() -> None:
    return None
