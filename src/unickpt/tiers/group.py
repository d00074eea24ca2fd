"""The memory tier's own gloo group: object collectives and files sent between ranks.

Its own group, so that replication and restore traffic never interleaves with the
collectives of saves and loads. Files go rank to rank as byte tensors straight out of and into
memory maps of the node folders' files (no copy in between): the sender maps its file, the
receiver maps the new file at its final size and receives into it in pieces of
``PIECE_BYTES``. Peak extra memory: none beyond the received file itself (which is the
replica) and gloo's own buffers.
"""

from __future__ import annotations

import contextlib
import datetime
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import DistributedCheckpointError

PIECE_BYTES = 64 << 20
T = TypeVar("T")


class TierGroup:
    """The ranks of one Checkpointer's group, on a gloo group of the memory tier's own."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        self._pg: Any = None
        self.timeout_s = timeout_s
        if dist.is_available() and dist.is_initialized():
            self.ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            self.rank = self.ranks.index(dist.get_rank())
            if len(self.ranks) > 1:
                whole = len(self.ranks) == dist.get_world_size()
                self._pg = dist.new_group(
                    ranks=list(self.ranks),
                    backend="gloo",
                    timeout=datetime.timedelta(seconds=timeout_s),
                    use_local_synchronization=not whole,
                )
        else:
            self.ranks, self.rank = (0,), 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_gather(self, obj: T) -> list[T]:
        if self._pg is None:
            return [obj]
        out: list[Any] = [None] * self.size
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

    def exchange(self, sends: list[Transfer], recvs: list[Transfer]) -> None:
        """Send and receive files at once (non-blocking both ways, so pairs may be mutual)."""
        if not sends and not recvs:
            return
        with contextlib.ExitStack() as stack, self._lost("file transfer"):
            works = []
            piece = buf = torch.empty(0)
            for t in sends:
                buf = stack.enter_context(_mapped(t.path, t.nbytes, write=False))
                for piece in _pieces(buf):
                    works.append(dist.isend(piece, self.ranks[t.peer], self._pg, tag=t.tag))
            for t in recvs:
                buf = stack.enter_context(_mapped(t.path, t.nbytes, write=True))
                for piece in _pieces(buf):
                    works.append(dist.irecv(piece, self.ranks[t.peer], self._pg, tag=t.tag))
            for w in works:
                if w is not None:
                    w.wait()
            del works, piece, buf  # the maps close once no tensor refers to them

    @contextlib.contextmanager
    def _lost(self, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as e:
            raise DistributedCheckpointError(
                f"rank {self.rank}: the memory tier's {what} among {self.size} ranks failed "
                f"({e}): a rank died or hung past {self.timeout_s:.0f} s. Memory checkpoints "
                "committed before stay loadable.",
                {},
            ) from e


@dataclass(frozen=True)
class Transfer:
    """One file going to or coming from ``peer`` (a group rank), under ``tag``."""

    path: Path
    nbytes: int
    peer: int
    tag: int


def _pieces(buf: torch.Tensor) -> list[torch.Tensor]:
    return [buf[i : i + PIECE_BYTES] for i in range(0, buf.numel(), PIECE_BYTES)]


@contextlib.contextmanager
def _mapped(path: Path, nbytes: int, write: bool) -> Iterator[torch.Tensor]:
    """The file as a uint8 tensor over a memory map (created at ``nbytes`` when writing)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY
    fd = os.open(path, flags, 0o644)
    try:
        if write:
            os.ftruncate(fd, nbytes)
        if nbytes == 0:
            yield torch.empty(0, dtype=torch.uint8)
            return
        access = mmap.ACCESS_WRITE if write else mmap.ACCESS_COPY
        mm = mmap.mmap(fd, nbytes, access=access)
        try:
            tensor = torch.frombuffer(mm, dtype=torch.uint8)
            yield tensor
            del tensor
        finally:
            with contextlib.suppress(BufferError):
                mm.close()
    finally:
        os.close(fd)
