"""The save queue: the process's saves in the order they were called, and the owner of their
staging memory.

Every save of the process (``save``, ``async_save``, zero-stall saves, a Checkpointer's, a
memory tier's, from whichever thread) is admitted here when it is called, and gets a
:class:`Turn`. A save runs its collectives and takes staging memory only in its turn: once every
save admitted before it has ended (committed or failed, its background work over). The staging
memory is one arena (:class:`StagingArena`), grown to the largest room a save asked for and
reused by the next, and lent to the save whose turn it is: no two saves ever share bytes in
flight. :meth:`SaveQueue.prepare` allocates it ahead, so the first save costs what later ones
do. See docs/async.md for the rules.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook first
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..engine.futures import SaveFuture

log = logging.getLogger(__name__)


class StagingArena:
    """A growable host buffer, reallocated only when a save needs more than it holds (or
    pinned memory where it holds pageable memory)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self._lock = threading.Lock()
        self.allocations = 0
        """How many times the arena was allocated (for tests and figures)."""

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def take(self, nbytes: int, pinned: bool, touch: bool = False) -> torch.Tensor:
        """The first ``nbytes`` of the arena, grown first where needed. ``touch``: write every
        page of a new buffer now (pageable memory is otherwise faulted in by its first copy)."""
        with self._lock:
            if self._buf is None or self._buf.numel() < nbytes or (pinned and not self._pinned):
                self._buf = None  # the old buffer goes before the new one is allocated
                self._buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
                self._pinned = pinned
                self.allocations += 1
                if touch and not pinned:
                    self._buf.zero_()
            return self._buf[:nbytes]

    def release(self) -> None:
        with self._lock:
            self._buf = None


class Turn:
    """One save's place in the queue; it ends (and the save's future is settled) once the
    save's work, in the call or in the background, is over."""

    def __init__(self, queue: SaveQueue, before: list[Turn], future: SaveFuture) -> None:
        self._queue = queue
        self._before = before
        self._ended = threading.Event()
        self.future = future

    def wait(self) -> None:
        """Wait until every save admitted before this one has ended."""
        for turn in self._before:
            turn._ended.wait()

    def room(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """``nbytes`` of staging memory, this save's until its turn ends."""
        assert all(t._ended.is_set() for t in self._before), "staging memory out of turn"
        return self._queue.arena.take(nbytes, pinned)

    def end(self, result: Any = None, error: BaseException | None = None) -> None:
        """Leave the queue (the next save may begin), then settle the save's future."""
        self._queue._leave(self)
        self._ended.set()
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)

    def proceed(self, work: Callable[[], Any], background: bool) -> Any:
        """Go on with ``work``: now, its result for the caller to end the turn with; or in the
        ``background``, on a thread of its own once the saves before this one have ended, then
        end with its outcome (not a daemon: an interpreter that exits joins it, so a save is
        never cut off midway)."""
        if not background:
            return work()

        def run() -> None:
            try:
                self.wait()
                result = work()
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                self.end(error=e)
            else:
                self.end(result)

        threading.Thread(target=run, name="unickpt-async-save", daemon=False).start()
        return None


class SaveQueue:
    """The process's saves, admitted in call order, one running at a time."""

    def __init__(self) -> None:
        self.arena = StagingArena()
        self._turns: list[Turn] = []
        self._lock = threading.Lock()

    def admit(self, future: SaveFuture) -> Turn:
        """A turn after every save admitted so far that has not ended."""
        with self._lock:
            turn = Turn(self, list(self._turns), future)
            self._turns.append(turn)
        return turn

    @contextmanager
    def turn(self) -> Iterator[Turn]:
        """A turn for work done in the caller's thread: waits for it, ends it after."""
        turn = self.admit(SaveFuture())
        try:
            turn.wait()
            yield turn
        finally:
            turn.end()

    def pending(self) -> list[Turn]:
        """The turns that have not ended, in order."""
        with self._lock:
            return list(self._turns)

    def wait_all(self) -> None:
        """Wait for every save admitted so far (their failures are their futures')."""
        for turn in self.pending():
            turn.future.wait_done()

    def prepare(self, nbytes: int, pinned: bool) -> SaveFuture:
        """Allocate ``nbytes`` of staging memory in the background, in turn (pinned: page-
        locked for copies from a GPU), and write every page, so that a save's copy does not
        pay for it. The future's result is the bytes the arena then holds."""
        turn = self.admit(SaveFuture())

        def allocate() -> int:
            self.arena.take(nbytes, pinned, touch=True)
            return self.arena.capacity_bytes

        turn.proceed(allocate, background=True)
        return turn.future

    def _leave(self, turn: Turn) -> None:
        with self._lock:
            if turn in self._turns:
                self._turns.remove(turn)


QUEUE = SaveQueue()


def _finish_at_exit() -> None:
    """An interpreter that exits first still completes (or fails) its pending saves."""
    pending = QUEUE.pending()
    if pending:
        log.info("waiting for %d asynchronous save(s) before exiting", len(pending))
    QUEUE.wait_all()


# Run before concurrent.futures stops accepting work at interpreter shutdown (its hook was
# registered at import, and these hooks run last-registered first).
_register = getattr(threading, "_register_atexit", atexit.register)
_register(_finish_at_exit)
