"""A Checkpointer's root: the one place that names, lists, locks, cleans and retires steps.

Below both the Checkpointer and the memory tier (they compose it; it knows neither). Its rules:

- **Agreed decisions.** What one rank reads or checks alone (the listing, a marker, the lock,
  the root's id) is decided on the coordinator and handed, with its error, to every rank
  (:func:`unickpt.dist.decide`): all ranks raise together or go on together, so a failed
  request never leaves one rank a save ahead of the others.
- **Keep what is not proven unreferenced.** Retention deletes a step only when every kept
  checkpoint's references were read and none names it; a failed read keeps everything (and
  says so). Debris is a step folder proven to hold no commit marker.
- **Uncommit first.** A step is deleted marker first, so a crash midway leaves debris, never a
  half-deleted checkpoint that looks whole.

Collective methods (every rank of ``comm``, in the same order): :meth:`Root.committed`,
:meth:`Root.lock`, :meth:`Root.check_lock`, :meth:`Root.identity`,
:meth:`Root.remove_interrupted`.
:meth:`Root.retain` runs on one rank (the coordinator, or the rank whose persist committed),
often in a background thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..dist import Broadcasting, decide, generation
from ..engine.references import needed_steps
from ..errors import CheckpointError
from ..format.metadata import COMMIT_FILE
from ..storage.base import HeldLock, Storage
from .identity import RootIdentity, ensure_root_id, read_root_id, resolved_location
from .names import committed_steps, step_folders, step_name

log = logging.getLogger(__name__)


class Root:
    """The step folders under one storage location, and the decisions about them."""

    def __init__(self, storage: Storage, comm: Broadcasting) -> None:
        self.storage = storage
        self.comm = comm
        self._held: HeldLock | None = None  # the writer lock, on the coordinator once taken

    @property
    def location(self) -> str:
        return self.storage.location

    def step(self, step: int) -> Storage:
        """The folder of ``step``."""
        return self.storage.child(step_name(step))

    # -- on this rank alone (raise when a request fails) ---------------------------------

    def list_committed(self) -> list[int]:
        """Committed steps, ascending, as this rank sees them now."""
        return committed_steps(self.storage)

    # -- collective: agreed by every rank ------------------------------------------------

    def committed(self) -> list[int]:
        """Committed steps, ascending: the coordinator's listing, on every rank."""
        return decide(self.comm, f"listing the checkpoints in {self.location}", self.list_committed)

    def lock(self) -> Callable[[], None]:
        """Take the root's writer lock on the coordinator (every rank learns the outcome);
        the release to call at the end (a no-op on the other ranks). A lock this process took
        before the job's membership changed (:func:`unickpt.dist.generation`) is taken over:
        the Checkpointer made again after a failure owns it, the earlier one's release does
        nothing."""
        held: list[HeldLock] = []

        def take() -> None:
            held.append(_take_lock(self.storage))

        decide(self.comm, f"locking the checkpoint root {self.location}", take)
        if not held:
            return _no_op
        self._held = held[0]

        def release() -> None:
            self._held = None
            held[0].release()

        return release

    def check_lock(self) -> None:
        """Before each save but the first: raise CheckpointLockedError on every rank when the
        lock taken by :meth:`lock` is no longer this writer's (another writer took it over),
        so that the job stops saving instead of writing beside the other."""
        held = self._held
        check = held.check if held is not None else _no_op
        decide(self.comm, f"checking the lock of {self.location}", check)

    def identity(self, create: bool) -> RootIdentity | None:
        """The root's identity, the same on every rank. ``create``: a writer (holding the
        lock) writes the root's id when it has none; otherwise None until a save wrote it."""

        def read() -> RootIdentity | None:
            root_id = ensure_root_id(self.storage) if create else read_root_id(self.storage)
            if root_id is None:
                return None
            return RootIdentity(resolved_location(self.storage), root_id)

        return decide(self.comm, f"reading the identity of {self.location}", read)

    def remove_interrupted(self) -> None:
        """Before a save: remove the folders of interrupted saves (the one about to be saved
        into too, when it holds no commit: it is saved into afresh). A cleanup that fails is
        logged, and the save goes on on every rank alike."""

        def clean() -> None:
            try:
                self.remove_debris()
            except CheckpointError as e:
                log.warning(
                    "could not look for folders of interrupted saves in %s (%s); they stay "
                    "until a later save removes them",
                    self.location,
                    e,
                )

        decide(self.comm, f"cleaning {self.location}", clean)

    # -- one rank ------------------------------------------------------------------------

    def remove_debris(self) -> list[int]:
        """Delete step folders proven to hold no commit marker."""
        removed = []
        for step, name in step_folders(self.storage).items():
            if self.storage.child(name).size(COMMIT_FILE) is None:
                log.info("removing %s, left by an interrupted save", self.step(step).location)
                if self._delete(name, uncommit=False):
                    removed.append(step)
        return removed

    def retain(self, newest: int, keep_last: int | None) -> list[int]:
        """Keep the ``keep_last`` newest steps up to ``newest`` (and every newer one), and
        every step a kept checkpoint refers to; delete the others. Returns the deleted steps.

        Never raises: retention is housekeeping. A listing or a read of a kept checkpoint's
        references that fails deletes nothing (the next retention tries again); nor does the
        holder of the root's lock once the lock is no longer its own.
        """
        if keep_last is None:
            return []
        try:
            if self._held is not None:  # a writer whose lock was taken deletes nothing
                self._held.check()
            committed = self.list_committed()
            older = [s for s in committed if s < newest]
            doomed = older[: max(0, len(older) - (keep_last - 1))]
            if not doomed:
                return []
            kept = [step_name(s) for s in committed if s not in doomed]
            needed = needed_steps(self.storage, kept)
        except CheckpointError as e:
            log.warning(
                "retention in %s deleted nothing: %s. Every step is kept; the next save's "
                "retention tries again.",
                self.location,
                e,
            )
            return []
        deleted = []
        for step in doomed:
            if step_name(step) not in needed and self._delete(step_name(step), uncommit=True):
                deleted.append(step)
        return deleted

    def _delete(self, name: str, uncommit: bool) -> bool:
        """Uncommit first, so a crash midway leaves debris, never a half-deleted checkpoint."""
        try:
            if uncommit:
                self.storage.child(name).remove(COMMIT_FILE)
            self.storage.remove_tree(name)
            return True
        except CheckpointError as e:
            log.warning("could not delete %s/%s (%s); delete it by hand", self.location, name, e)
            return False


def _no_op() -> None:
    return None


@dataclass
class _Held:
    """A root's lock this process holds: the lock, the membership generation it was taken or
    taken over in, and the token of the release that owns it now."""

    lock: HeldLock
    generation: int
    owner: object


_HELD: dict[str, _Held] = {}  # by the root's resolved location
_HELD_LOCK = threading.Lock()


def _take_lock(storage: Storage) -> HeldLock:
    """The storage's lock, or the one this process holds from an older membership."""
    key, token, now = resolved_location(storage), object(), generation()
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is not None and held.generation < now:
            log.info("taking over the lock of %s, held since before a failure", storage.location)
            held.generation, held.owner = now, token
            return HeldLock(_releaser(key, token), held.lock.check)
    lock = storage.acquire_lock()  # raises when held by anyone, this process included
    with _HELD_LOCK:
        _HELD[key] = _Held(lock, now, token)
    return HeldLock(_releaser(key, token), lock.check)


def _releaser(key: str, token: object) -> Callable[[], None]:
    def release() -> None:
        with _HELD_LOCK:
            held = _HELD.get(key)
            if held is None or held.owner is not token:
                return  # taken over by a later Checkpointer of this process
            del _HELD[key]
        held.lock.release()

    return release
