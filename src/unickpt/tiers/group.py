"""The memory tier's own gloo group: object collectives and files sent between ranks.

Its own group, so that replication and restore traffic never interleaves with the
collectives of saves and loads. Files go rank to rank as byte tensors straight out of and into
memory maps of the node folders' files (no copy in between), in pieces of ``PIECE_BYTES``: the
receiver sizes the new file (a recycled spare where there is one) and maps each piece just
before it arrives, so that its pages are made while the previous pieces are already being read;
an :class:`Arrivals` says how far each received file has come, for readers that go along with
the transfer. A transfer may carry only some byte ranges of a file, received straight into
the training state (:mod:`unickpt.tiers.direct`). Peak extra memory: none beyond the received
file itself (which is the replica), a scratch piece for runs of small chunks, and gloo's own
buffers.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..dist import OwnGroup
from ..engine.scratch import Scratch
from ..errors import CheckpointCorruptError, DistributedCheckpointError
from .direct import Targets, messages

PIECE_BYTES = 64 << 20
DIRECT_PIECE_BYTES = 8 << 20  # received straight into the state: verified while the next comes
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
T = TypeVar("T")


class TierGroup:
    """The ranks of one Checkpointer's group, on a gloo group of the memory tier's own."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        self._group: OwnGroup | None = None
        self.timeout_s = timeout_s
        if dist.is_available() and dist.is_initialized():
            self.ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            self.rank = self.ranks.index(dist.get_rank())
            if len(self.ranks) > 1:
                self._group = OwnGroup(self.ranks, timeout_s)
        else:
            self.ranks, self.rank = (0,), 0

    @property
    def _pg(self) -> Any:
        return None if self._group is None else self._group.pg

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def all_gather(self, obj: T) -> list[T]:
        if self._pg is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._lost("all_gather"):
            dist.all_gather_object(out, obj, group=self._pg)
        return out

    def broadcast(self, obj: T, src: int = 0) -> T:
        if self._pg is None:
            return obj
        box = [obj]
        with self._lost("broadcast"):
            dist.broadcast_object_list(box, src=self.ranks[src], group=self._pg)
        return box[0]

    def barrier(self) -> None:
        if self._pg is not None:
            with self._lost("barrier"):
                dist.barrier(group=self._pg)

    def exchange(
        self,
        transfers: list[Transfer],
        arrived: Callable[[Path, int], None] | None = None,
        targets: Targets | None = None,
    ) -> None:
        """Send or receive each transfer in turn (``send`` says which), blocking; after each
        received piece, ``arrived(path, bytes so far)``. A transfer with ``ranges`` moves those
        byte ranges only, received into ``targets`` (:mod:`unickpt.tiers.direct`).

        Every rank passes its part of one list all ranks agree on, in that list's order; so the
        earliest unfinished transfer always has both ends waiting for it and nothing deadlocks,
        while transfers between other pairs go on at the same time. (One direction at a time
        per pair: gloo moves a large tensor both ways at once far slower than one way twice.)

        A rank that cannot open, size or map its side of a file (gone, cut short, memory full)
        still moves the file's bytes (zeros sent, or received into a scratch buffer), so that
        its peer never waits for them, and raises :class:`CheckpointCorruptError` naming the
        files once every transfer is done; the caller hands that outcome to every rank (a
        restore then falls back to storage on every rank).
        """
        failed: list[str] = []
        with self._lost("file transfer"), ThreadPoolExecutor(1, "unickpt-map") as pool:
            for t in transfers:
                if t.ranges:
                    failure = self._ranges(t, arrived, targets)
                else:
                    failure = self._whole(t, arrived, pool)
                if failure is not None:
                    failed.append(failure)
        if failed:  # a memory file that cannot be used is as good as damaged
            raise CheckpointCorruptError(
                f"rank {self.rank}: the memory tier could not use {len(failed)} file(s) it "
                f"moves: {'; '.join(failed[:3])}. Their bytes went as zeros (nothing waits for "
                "them, and nothing counts them as whole); free memory in the node folder or "
                "check it for files changed from outside."
            )

    def _whole(
        self, t: Transfer, arrived: Callable[[Path, int], None] | None, pool: ThreadPoolExecutor
    ) -> str | None:
        """Move a whole file, piece by piece; on a local failure, move the rest as blanks
        (:meth:`_blank`) and return what failed."""
        done = 0
        try:
            with _opened(t.path, t.nbytes, write=not t.send) as fd:
                for end, piece in _pieces(fd, t.nbytes, not t.send, pool):
                    self._move(piece, t)
                    del piece  # the map closes once no tensor refers to it
                    done = end
                    if arrived is not None and not t.send:
                        arrived(t.path, end)
        except (OSError, ValueError) as e:  # ValueError: a map past the end of a cut file
            self._blank(t, done)
            return f"{t.path} ({e})"
        return None

    def _move(self, piece: torch.Tensor, t: Transfer) -> None:
        if t.send:
            dist.send(piece, self.ranks[t.peer], self._pg, tag=t.tag)
        else:
            dist.recv(piece, self.ranks[t.peer], self._pg, tag=t.tag)

    def _blank(self, t: Transfer, start: int) -> None:
        """Move bytes ``[start, nbytes)`` of ``t`` without its file, in the same pieces: zeros
        sent, or received into a scratch piece and dropped."""
        if start >= t.nbytes:
            return
        scratch = torch.zeros(min(PIECE_BYTES, t.nbytes - start), dtype=torch.uint8)
        for at in range(start, t.nbytes, PIECE_BYTES):
            self._move(scratch[: min(PIECE_BYTES, t.nbytes - at)], t)

    def _ranges(
        self,
        t: Transfer,
        arrived: Callable[[Path, int], None] | None,
        targets: Targets | None,
    ) -> str | None:
        """Send the ranges of ``t`` out of a map of its file, or receive them into ``targets``;
        a sender that cannot map the file sends zeros and returns what failed."""
        peer = self.ranks[t.peer]
        cut = messages(t.ranges, min(PIECE_BYTES, DIRECT_PIECE_BYTES))
        if t.send:
            sent = 0
            try:
                with _opened(t.path, t.nbytes, write=False) as fd, _mapped(fd, t.nbytes) as whole:
                    for m in cut:
                        dist.send(whole[m.start : m.end], peer, self._pg, tag=t.tag)
                        sent += 1
            except (OSError, ValueError) as e:  # ValueError: a map past the end of a cut file
                for m in cut[sent:]:
                    blank = torch.zeros(m.end - m.start, dtype=torch.uint8)
                    dist.send(blank, peer, self._pg, tag=t.tag)
                return f"{t.path} ({e})"
            return None
        assert targets is not None
        scratch = Scratch()
        for m in cut:
            targets.receive(
                t.path, m, lambda x: dist.recv(x, peer, self._pg, tag=t.tag), scratch.take
            )
            if arrived is not None:
                arrived(t.path, m.end)
        if arrived is not None:
            arrived(t.path, t.nbytes)
        return None

    def pass_files(self, folder: Path, passes: list[Pass]) -> dict[str, bytes]:
        """Small files of ``folder`` (on each sender's node), whole, rank to rank into memory:
        every rank walks the same list and sends or receives its part, in order (the argument
        of :meth:`exchange`: nothing deadlocks). Returns the files this rank received. A file
        its sender cannot read whole goes as zeros (or cut to its expected size), so that the
        receiver's checksum refuses it instead of a transfer failing halfway."""
        got: dict[str, bytes] = {}
        with self._lost("index file transfer"):
            for tag, p in enumerate(passes):
                if self.rank not in (p.sender, p.receiver):
                    continue
                if p.nbytes == 0:  # nothing to send
                    if self.rank == p.receiver:
                        got[p.name] = b""
                    continue
                if self.rank == p.sender:
                    data = b""
                    with contextlib.suppress(OSError):
                        data = (folder / p.name).read_bytes()[: p.nbytes]
                    out = torch.frombuffer(
                        bytearray(data.ljust(p.nbytes, b"\0")), dtype=torch.uint8
                    )
                    dist.send(out, self.ranks[p.receiver], self._pg, tag=tag)
                else:
                    buf = torch.empty(p.nbytes, dtype=torch.uint8)
                    dist.recv(buf, self.ranks[p.sender], self._pg, tag=tag)
                    got[p.name] = buf.numpy().tobytes()
        return got

    @contextlib.contextmanager
    def _lost(self, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as e:
            raise DistributedCheckpointError(
                f"rank {self.rank}: the memory tier's {what} among {self.world_size} ranks failed "
                f"({e}): a rank died or hung past {self.timeout_s:.0f} s. Memory checkpoints "
                "committed before stay loadable.",
                {},
            ) from e


@dataclass(frozen=True)
class Transfer:
    """One file going to (``send``) or coming from ``peer`` (a group rank), under ``tag``;
    only its byte ranges ``(offset, nbytes)`` when ``ranges`` (sorted) names some."""

    path: Path
    nbytes: int
    peer: int
    tag: int
    send: bool
    ranges: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Pass:
    """File ``name`` (``nbytes``) going whole from group rank ``sender`` to ``receiver``."""

    sender: int
    receiver: int
    name: str
    nbytes: int


@contextlib.contextmanager
def _opened(path: Path, nbytes: int, write: bool) -> Iterator[int]:
    """The file's descriptor; when writing, created (or a spare reused) at ``nbytes``, its
    memory allocated up front: a full tmpfs then fails here (ENOSPC) rather than stopping the
    process with SIGBUS at the first byte received into a page it cannot have."""
    flags = os.O_RDWR | os.O_CREAT if write else os.O_RDONLY  # a spare file is overwritten
    fd = os.open(path, flags, 0o644)
    try:
        if write:
            os.ftruncate(fd, nbytes)
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _mapped(fd: int, nbytes: int) -> Iterator[torch.Tensor]:
    """The whole file, read-only, as a uint8 tensor over a populated memory map."""
    if not nbytes:
        yield torch.empty(0, dtype=torch.uint8)
        return
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only: sent, never written
            tensor = torch.frombuffer(mm, dtype=torch.uint8)
        yield tensor
        del tensor
    finally:
        with contextlib.suppress(BufferError):
            mm.close()


def _pieces(
    fd: int, nbytes: int, write: bool, pool: ThreadPoolExecutor
) -> Iterator[tuple[int, torch.Tensor]]:
    """Each piece of the file as a uint8 tensor over a memory map, with the end of the piece.
    The next piece is mapped in ``pool`` meanwhile: making the pages of a new tmpfs file
    costs about as much as sending them, and so overlaps the transfer of the piece before."""
    starts = list(range(0, nbytes, PIECE_BYTES))

    def map_at(k: int) -> mmap.mmap:
        n = min(PIECE_BYTES, nbytes - starts[k])
        # Populated in one call, not faulted in page by page. Read-only when reading (the
        # tensor is only ever sent from).
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        return mmap.mmap(fd, n, flags=mmap.MAP_SHARED | _POPULATE, prot=prot, offset=starts[k])

    ahead = pool.submit(map_at, 0) if starts else None
    try:
        for k, start in enumerate(starts):
            assert ahead is not None
            mm = ahead.result()
            ahead = pool.submit(map_at, k + 1) if k + 1 < len(starts) else None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only: sent, never written
                    tensor = torch.frombuffer(mm, dtype=torch.uint8)
                yield start + len(mm), tensor
                del tensor
            finally:
                with contextlib.suppress(BufferError):
                    mm.close()
    finally:
        if ahead is not None:  # the transfer stopped early: the piece mapped ahead is unused
            with contextlib.suppress(Exception):
                ahead.result().close()


class Arrivals:
    """How many leading bytes of each file being received are there; readers wait for theirs.

    ``fail`` wakes every reader with the transfer's error; a file not being received is never
    waited for.
    """

    def __init__(self, sizes: dict[Path, int]) -> None:
        self.sizes = dict(sizes)
        self._done = dict.fromkeys(sizes, 0)
        self._error: BaseException | None = None
        self._cv = threading.Condition()

    def arrived(self, path: Path, nbytes: int) -> None:
        with self._cv:
            self._done[path] = nbytes
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify_all()

    def wait(self, path: Path, end: int) -> None:
        """Return once bytes ``[0, end)`` of ``path`` are there (at once when it is not being
        received); raise the transfer's error when it failed first."""
        if path not in self._done:
            return
        with self._cv:
            while self._done[path] < end:
                if self._error is not None:
                    raise DistributedCheckpointError(
                        f"{path} stopped arriving after {self._done[path]} of "
                        f"{self.sizes[path]} bytes: {self._error}",
                        {},
                    ) from self._error
                self._cv.wait()
