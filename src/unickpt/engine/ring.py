"""The bounded ring: a snapshot copied through at most ``budget`` bytes of host memory.

When a rank's state is larger than its staging budget, the snapshot cannot hold a copy of all
of it. The :class:`Stager` instead copies the file's parts, in file order, into a ring of
``budget`` bytes (pinned when a source is on a GPU) on its own thread; the writer threads take
each part once its bytes are staged and give its room back once the part is written, so the
copy runs at most ``budget`` bytes ahead of the writes. The copy of the last part ends when all
but about ``budget`` bytes of the state are written: that is when the snapshot is done (the
tensors may change again) and when the optimizer steps that wait for it go on.

Each part's bytes lie in one contiguous region of the ring; a region that does not fit before
the ring's end starts at its beginning. Parts are cut small enough (:meth:`Stager.part_bytes`)
that several fit, so copies and writes overlap.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

import torch

from ..errors import CheckpointError
from ..format.dtypes import buffer_of
from .parts import Part
from .sources import needs_pinned, span_bytes

_RING_PARTS = 6
"""About how many parts the ring holds at once: enough for the writer threads and the copy."""


class Stager:
    """Copies the parts of one data file into a ring of host memory ahead of their writes.

    ``views[i]`` are the tensors of the file's items; ``room`` is the ring's memory (its
    bytes are the budget; pinned where a view is on a GPU). ``check(i)`` runs once item ``i`` is
    wholly copied; ``on_copied()`` once every part is copied, or the copy has stopped (after
    an error, or :meth:`stop`). An error of the copy (or of ``check``) is raised to the writer
    threads waiting for parts, so the file is aborted and the save fails on every rank.
    """

    def __init__(
        self,
        views: Sequence[torch.Tensor],
        room: torch.Tensor,
        check: Callable[[int], None] | None = None,
        on_copied: Callable[[], None] | None = None,
    ) -> None:
        self._views = list(views)
        self._budget = room.numel()
        self._ring = room
        self._check = check
        self._on_copied = on_copied
        self._pinned = needs_pinned(self._views)
        self._cond = threading.Condition()
        self._live: collections.deque[list[int]] = collections.deque()  # [part, start, end, done]
        self._staged: dict[int, int] = {}  # part index -> start of its region in the ring
        self._error: BaseException | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self.peak_bytes = 0
        """The most ring bytes held at once (staged or being written)."""

    def part_bytes(self, target: int, segment: int) -> int:
        """The part size to plan the file with: ``target``, lowered so that about
        ``_RING_PARTS`` parts fit in the budget, in whole segments (at least one). Chunks of
        this size or more are cut, so a part holds less than twice it (a budget of at least
        two segments holds any part of a local file)."""
        share = self._budget // _RING_PARTS // segment * segment
        return max(segment, min(target, share))

    def start(self, parts: Sequence[Part]) -> None:
        """Start copying ``parts`` (the file's, in order) on the stager's thread."""
        largest = max((_payload(p) for p in parts), default=0)
        if largest > self._budget:
            self._fail(
                CheckpointError(
                    f"the staging budget is {self._budget:,} bytes, but the storage takes this "
                    f"file in parts of up to {largest:,} bytes (object stores take parts of at "
                    f"least 5 MiB); pass staging_bytes of at least {2 * largest:,}."
                )
            )
            return
        self._thread = threading.Thread(
            target=self._run, args=(list(parts),), name="unickpt-stager", daemon=True
        )
        self._thread.start()

    def buffers(self, part: Part) -> list[memoryview | None]:
        """The staged bytes of each span of ``part`` (None for padding); waits for the copy."""
        with self._cond:
            while part.index not in self._staged:
                if self._error is not None:
                    raise self._error
                if self._stopped:
                    raise RuntimeError("the staged save was stopped")
                self._cond.wait()
            at = self._staged[part.index]
        out: list[memoryview | None] = []
        for span in part.spans:
            if span.item is None:
                out.append(None)
                continue
            out.append(buffer_of(self._ring[at : at + span.nbytes]))
            at += span.nbytes
        return out

    def release(self, part: Part) -> None:
        """Give the room of a written part back to the ring."""
        with self._cond:
            self._staged.pop(part.index, None)
            for entry in self._live:
                if entry[0] == part.index:
                    entry[3] = 1
            while self._live and self._live[0][3]:
                self._live.popleft()
            self._cond.notify_all()

    def stop(self) -> None:
        """Stop copying (the write failed); waits for the copy thread to let go of the ring."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._finish_copy()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()
        self._finish_copy()

    def _finish_copy(self) -> None:
        if not self._copied.is_set():
            self._copied.set()
            if self._on_copied is not None:
                self._on_copied()

    def _run(self, parts: list[Part]) -> None:
        remaining = [0] * len(self._views)  # the bytes of each item not yet copied
        for p in parts:
            for s in p.spans:
                if s.item is not None:
                    remaining[s.item] += s.nbytes
        try:
            for part in parts:
                at = self._reserve(part) if _payload(part) else 0
                if at is None:
                    return
                done = self._copy(part, at, remaining)
                with self._cond:
                    self._staged[part.index] = at
                    self._cond.notify_all()
                if self._check is not None:
                    for i in done:
                        self._check(i)
        except BaseException as e:  # noqa: BLE001 - raised to the writer threads
            self._fail(e)
            return
        self._finish_copy()

    def _reserve(self, part: Part) -> int | None:
        """A region of the ring for ``part`` (waits for room); None when stopped or failed."""
        n = _payload(part)
        with self._cond:
            while True:
                if self._stopped or self._error is not None:
                    return None
                at = self._fit(n)
                if at is not None:
                    self._live.append([part.index, at, at + n, 0])
                    held = sum(e[2] - e[1] for e in self._live)
                    self.peak_bytes = max(self.peak_bytes, held)
                    return at
                self._cond.wait()

    def _fit(self, n: int) -> int | None:
        if not self._live:
            return 0
        first, last = self._live[0], self._live[-1]
        tail, head = first[1], last[2]
        if last[1] >= first[1]:  # not wrapped: the live regions lie in [tail, head)
            if head + n <= self._budget:
                return head
            return 0 if n <= tail else None
        return head if head + n <= tail else None  # wrapped: live in [tail, end) + [0, head)

    def _copy(self, part: Part, at: int, remaining: list[int]) -> list[int]:
        """Copy the part's spans to the ring at ``at``; the items now wholly copied."""
        done = []
        with torch.no_grad():
            for span in part.spans:
                if span.item is None:
                    continue
                dst = self._ring[at : at + span.nbytes]
                dst.copy_(
                    span_bytes(self._views[span.item], span.start, span.nbytes),
                    non_blocking=self._pinned,
                )
                at += span.nbytes
                remaining[span.item] -= span.nbytes
                if remaining[span.item] == 0:
                    done.append(span.item)
            if self._pinned:
                torch.cuda.synchronize()
        return done


def _payload(part: Part) -> int:
    return sum(s.nbytes for s in part.spans if s.item is not None)
