"""Checkpointer: numbered checkpoints under one root, for training loops.

One folder per step (``step-000000100``), counted only once committed; the newest intact one
is found on restart, damaged ones are skipped with a warning; old ones are deleted only after
a newer one is committed; folders left by an interrupted save are removed by a later save.
The root is any path or URL a storage backend serves. The Checkpointer composes the root
(:mod:`unickpt.root`: names, listing, the lock, retention, debris, the root's identity), the
save policy (``every``, the interval tuner), the tiers (:mod:`unickpt.tiers`) and the engine.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import api
from .config import Config, get_config
from .dist import Comm, decide, dedicated_comm
from .encoding.saving import check_quantize
from .engine.commit import read_checkpoint
from .engine.compress import check_compress
from .engine.futures import SaveFuture
from .engine.incremental import Basis, IncrementalSave
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)
from .format.metadata import Metadata
from .layouts.rules import LayoutMap
from .planning.load_keys import KeyMap, StateKeys
from .root import Root, RootIdentity
from .root.names import committed_steps, open_checkpoint, step_folders, step_name
from .saving import pipeline
from .saving.pipeline import MODES
from .saving.save import Save, SaveOptions
from .storage.base import Storage
from .storage.registry import open_storage
from .tuning import IntervalTuner, Tuning
from .tuning.restarts import mtbf_from_starts, record_start

if TYPE_CHECKING:
    from .tiers.memory import MemoryTier
    from .tiers.policy import MemoryStats, RestoreInfo

log = logging.getLogger(__name__)

__all__ = ["Checkpointer", "committed_steps", "open_checkpoint", "step_folders", "step_name"]


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
    save (see :func:`unickpt.save`); ``compress=True`` stores every save losslessly compressed.
    ``staging_bytes`` bounds the host memory an asynchronous save's snapshot takes (see
    :func:`unickpt.async_save`). ``layout`` (patterns of keys -> wrappers: fused, padded and
    replicated tensors, see docs/layouts.md) applies to every save and load. ``keys`` (a dict
    or a function from state key to saved key, as for :func:`unickpt.save`) renames the keys
    of every save, and ``load_latest`` reads them back under the state's keys.

    ``mode`` is how each save runs: ``"async"`` (the default: :meth:`save` returns once the
    state is copied, the write goes on in the background), ``"sync"`` (returns once
    committed) or ``"zero_stall"`` (returns at once; the copy overlaps the next forward and
    backward, the next optimizer step waits for it; see :func:`unickpt.async_save`).
    ``async_save=False`` and ``background_snapshot=True`` are its former spellings
    (deprecated).

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
        mode: str = "async",
        config: Config | None = None,
        memory: MemoryTier | None = None,
        incremental: bool = False,
        full_every: int = 8,
        row_deltas: Sequence[str] = (),
        every: int | str | None = None,
        max_overhead: float = 0.01,
        mtbf_s: float | None = None,
        quantize: Mapping[str, int] | None = None,
        compress: bool = False,
        staging_bytes: int | None = None,
        layout: LayoutMap | None = None,
        keys: KeyMap | None = None,
        async_save: bool | None = None,
        background_snapshot: bool | None = None,
    ) -> None:
        mode = _mode(mode, async_save, background_snapshot)
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last is {keep_last}; expected None or at least 1.")
        if full_every < 1:
            raise CheckpointError(f"full_every is {full_every}; expected at least 1.")
        if row_deltas and not incremental:
            raise CheckpointError("row_deltas needs incremental=True; pass both.")
        if keys is not None and memory is not None:
            raise CheckpointError(
                "keys= and a memory tier were both given; a memory tier saves and restores "
                "under the state's own keys. Pass one of them."
            )
        if incremental and memory is not None:
            raise CheckpointError(
                "incremental=True and a memory tier were both given; incremental saves are "
                "for checkpoints written straight to storage. Pass one of them."
            )
        self.storage = open_storage(root)
        self.keep_last = keep_last
        self.group = group
        self.mode = mode
        self.config = config or get_config()
        self.quantize = check_quantize(quantize)
        self.compress = check_compress(compress)  # lossless, per chunk: unickpt.save's
        self.staging_bytes = staging_bytes  # host memory of a snapshot: async_save's
        self.layout = layout  # fused, padded, replicated tensors: save's and load's
        self.keys = keys  # state key -> saved key, in every save and (inversely) load
        self._comm = Comm(group, self.config.collective_timeout_s)
        self._root = Root(self.storage, self._comm)
        self._pending: SaveFuture | None = None
        self._release: Callable[[], None] | None = None
        self._identity: RootIdentity | None = None
        # -- memory tier (unickpt.tiers): the policy lives there, delegated to from here --
        self.last_restore: RestoreInfo | None = None
        self._tier = None
        if memory is not None:
            from .tiers.policy import SaveSettings, TierPolicy

            settings = SaveSettings(group, self.config, keep_last, layout)
            self._tier = TierPolicy(self._root, memory, settings)
        self._basis = Basis(full_every, row_deltas) if incremental else None
        # -- interval tuner (unickpt.tuning): maybe_save decides when to save --
        self._tuner: IntervalTuner | None = None
        if every is not None:
            self._tuner = IntervalTuner(every, max_overhead, mtbf_s, agree=self._agree_interval)
            # Its collectives run while saves write in the background: a group of their own.
            self._tuner_comm = dedicated_comm(group, self.config.collective_timeout_s)
        self._started = False
        self._last_step: int | None = None  # of the last save called

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
        return self._root.step(step).location

    def steps(self) -> list[int]:
        """Committed steps, ascending (as this rank lists them; raises when listing fails)."""
        return self._root.list_committed()

    def save(self, step: int, state: dict[str, Any]) -> SaveFuture:
        """Save ``state`` as ``step``, as ``mode`` says (by default asynchronously).

        The first save locks the root (:class:`~unickpt.errors.CheckpointLockedError` when
        another job writes into it), writes the root's id when it has none, and removes
        folders left by interrupted saves. Every later save first checks that the lock is
        still this job's, and raises CheckpointLockedError on every rank when another writer
        took it over. Whatever the coordinator reads or checks before the
        save is handed to every rank with its error: a save that fails, fails on every rank,
        and every rank is ready for the next one.
        """
        self.wait()
        if step < 0:
            raise CheckpointError(f"step is {step}; expected a non-negative integer.")
        first = self._release is None
        if first:
            self._release = self._root.lock()
        else:
            self._root.check_lock()  # another writer took the lock: every rank stops here
        if self._identity is None:
            self._identity = self._root.identity(create=True)
        if first or self._tier is None:  # with a memory tier, persists may be under way later
            self._root.remove_interrupted()
        if self._tier is not None:
            assert self._identity is not None  # written by the line above
            self._tier.bind(self._identity)
            target, on_commit = self._tier.begin_save(step)
            inc = None
        else:
            target, inc = self._root.step(step), self._next_incremental(step, first)
            on_commit = lambda: self._retain(step)  # noqa: E731
        options = SaveOptions(
            overwrite=True,
            quantize=self.quantize,
            compress=self.compress,
            lock=False,
            layout=self.layout,
            keys=self.keys,
            staging_bytes=self.staging_bytes,
            incremental=inc,
            on_commit=on_commit,
        )
        self._pending = pipeline.run(
            Save(target, self.group, self.config, options), state, self.mode
        )
        if self._tier is not None:
            self._tier.pending = self._pending
        self._last_step = step
        return self._pending

    def prepare_staging(self, state: dict[str, Any]) -> SaveFuture:
        """Allocate ahead, in the background, the host memory this Checkpointer's saves of
        ``state`` copy into (within ``staging_bytes``), so that the first save costs what
        later ones do; see :func:`unickpt.prepare_staging`. Nothing with ``mode="sync"``.

        >>> ckpt.load_latest(state)  # doctest: +SKIP
        >>> ckpt.prepare_staging(state)  # doctest: +SKIP
        """
        if self.mode == "sync":
            return SaveFuture.completed(0)
        return pipeline.prepare_staging(state, self.config, self.staging_bytes, self.layout)

    def _next_incremental(self, step: int, first: bool) -> IncrementalSave | None:
        """The incremental save of ``step`` (None without ``incremental=True``). The first
        starts from the newest committed step before ``step`` (a restarted job), so the save
        refers to its unchanged chunks. Read on the coordinator and handed to every rank; a
        checkpoint that does not read leaves the save full on every rank."""
        if self._basis is None:
            return None

        def newest_older() -> tuple[str, Metadata] | None:
            older = [s for s in self._root.list_committed() if s < step]
            if not older:
                return None
            try:
                _, meta = read_checkpoint(self._root.step(older[-1]))
            except CheckpointError as e:
                log.info(
                    "incremental save of step %d is full: step %d does not read (%s)",
                    step,
                    older[-1],
                    e,
                )
                return None
            return step_name(older[-1]), meta

        what = f"reading the newest checkpoint of {self.root}"
        found = decide(self._comm, what, newest_older) if first else None
        if found is not None:
            self._basis.seed(*found)
        alive = {step_name(s) for s in self._root.committed()}
        return self._basis.next_save(step_name(step), self.config.segment_bytes, alive.__contains__)

    def _retain(self, newest: int) -> None:
        """Retention after ``newest`` committed: on the coordinator only, never raising."""
        if self._comm.is_coordinator:
            self._root.retain(newest, self.keep_last)

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
            tuner.learn_mtbf(decide(self._tuner_comm, "recording this start", self._learn_mtbf))
        if not tuner.begin(step):
            tuner.end(step, saved=False)
            return None
        future = self.save(step, state)
        tuner.end(step, saved=True, done=future.done if self.mode != "sync" else None)
        return future

    @property
    def tuning(self) -> Tuning | None:
        """What the interval tuner measured and chose (None without ``every``)."""
        return None if self._tuner is None else self._tuner.tuning

    def _learn_mtbf(self) -> float | None:
        """Record this start at the root (coordinator); the MTBF the starts imply. A record
        that cannot be written leaves the MTBF unknown for this run."""
        now = time.time()
        try:
            return mtbf_from_starts(record_start(self.storage, now), now)
        except CheckpointError as e:
            log.warning("could not record this start in %s (%s); MTBF unknown", self.root, e)
            return None

    def _agree_interval(self, every: int) -> int:
        """Every rank saves at the same steps: the longest interval any rank proposes."""
        return max(self._tuner_comm.all_gather(every))

    def load_latest(self, state: dict[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest intact checkpoint into ``state``; its step.

        Returns None only when the root holds no committed step. Otherwise it returns a step
        whose values are all in ``state`` (falling back from damaged steps to older ones, and
        listing again when steps are deleted under it by a writer's retention), or raises
        :class:`~unickpt.errors.CheckpointError` naming every step tried and why it failed;
        ``state`` then may hold values written by the failed loads.
        """
        self.wait()
        if self._tier is not None:
            if self._identity is None:
                self._identity = self._root.identity(create=False)
            if self._identity is not None:
                self._tier.bind(self._identity)
            step, self.last_restore = self._tier.load_latest(
                state, strict, lambda failed: self._load_stored(state, strict, failed)
            )
            return step
        return self._load_stored(state, strict, {})

    def _load_stored(
        self, state: dict[str, Any], strict: bool, failed: dict[str, str]
    ) -> int | None:
        """The newest committed step that loads whole; ``failed``: earlier sources that did
        not (source -> why), reported with this one's."""
        tried: dict[int, str] = {}
        while True:
            untried = [s for s in self._root.committed() if s not in tried]
            if not untried:
                break
            step = untried[-1]
            try:
                report = api.load(
                    self._root.step(step),
                    state,
                    group=self.group,
                    strict=strict,
                    config=self.config,
                    layout=self.layout,
                    keys=None if self.keys is None else StateKeys(self.keys),
                )
            except CheckpointError as e:
                if not self._fall_back(step, e):
                    raise
                tried[step] = str(e)
                continue
            if (tried or failed) and report.skipped_keys:
                warnings.warn(
                    f"step {step} was loaded after failed loads of "
                    f"{', '.join([*failed, *map(str, tried)])}; keys it does not hold kept "
                    "values those loads may have written: "
                    f"{', '.join(report.skipped_keys[:10])}",
                    stacklevel=3,
                )
            return step
        if not tried and not failed:
            return None
        lines = [f"  {src}: {why}" for src, why in failed.items()]
        lines += [f"  step {s} ({self.path(s)}): {why}" for s, why in tried.items()]
        raise CheckpointCorruptError(
            f"no checkpoint of {self.root} could be loaded; tried, newest first:\n"
            + "\n".join(lines)
            + "\nThe state may hold values that these loads wrote before failing: make it anew "
            "before using it. Repair or restore one of these checkpoints, or start afresh "
            "in another root."
        )

    def _fall_back(self, step: int, error: CheckpointError) -> bool:
        """Whether a failed load of ``step`` lets an older step be tried: the step is damaged,
        or was deleted under the load (listed again: every rank sees the same listing)."""
        if step not in self._root.committed():
            log.info("step %d was deleted while it was loaded; listing the steps again", step)
            return True
        if isinstance(error, CheckpointCorruptError | CheckpointNotFoundError):
            warnings.warn(
                f"checkpoint of step {step} at {self.path(step)} cannot be loaded ({error}); "
                "falling back to the one before.",
                stacklevel=4,
            )
            return True
        return False

    def wait(self) -> None:
        """Wait for the pending asynchronous save; re-raise its failure."""
        pending = self._pending
        try:
            if pending is not None and not (pending.done() and pending.error_reported):
                pending.wait()
        finally:  # cleared once over: a signal handler run in the wait still sees it
            self._pending = None

    def close(self, final_step: int | None = None, state: dict[str, Any] | None = None) -> None:
        """Wait for pending saves and release the root; with a memory tier, persist what
        storage lacks and free the job's memory.

        With ``final_step`` and ``state`` (a loop's last step, which its ``every`` or its own
        interval may have left unsaved), ``state`` is saved as ``final_step`` first, unless this
        Checkpointer's last save was that step. Every rank passes the same.
        """
        if (final_step is None) != (state is None):
            raise CheckpointError(
                "close() takes final_step and state together (the loop's last step and its "
                "state), or neither."
            )
        try:
            if final_step is not None and state is not None and final_step != self._last_step:
                self.save(final_step, state)
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


def _mode(mode: str, async_save: bool | None, background_snapshot: bool | None) -> str:
    """``mode``, or what the former flags ``async_save`` and ``background_snapshot`` said."""
    if mode not in MODES:
        raise CheckpointError(f"mode is {mode!r}; expected one of {', '.join(map(repr, MODES))}.")
    if async_save is None and background_snapshot is None:
        return mode
    old = "sync" if async_save is False else "zero_stall" if background_snapshot else "async"
    warnings.warn(
        f"Checkpointer(async_save=..., background_snapshot=...) is deprecated; pass "
        f"mode={old!r} instead.",
        DeprecationWarning,
        stacklevel=3,
    )
    if mode != "async" and mode != old:
        raise CheckpointError(
            f"mode={mode!r} and the deprecated flags (async_save={async_save}, "
            f"background_snapshot={background_snapshot}) disagree; pass mode only."
        )
    return old
