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
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import DistributedCheckpointError

PIECE_BYTES = 64 << 20
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
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

    def exchange(self, transfers: list[Transfer]) -> None:
        """Send or receive each transfer in turn (``send`` says which), blocking.

        Every rank passes its part of one list all ranks agree on, in that list's order; so the
        earliest unfinished transfer always has both ends waiting for it and nothing deadlocks,
        while transfers between other pairs go on at the same time. (One direction at a time
        per pair: gloo moves a large tensor both ways at once far slower than one way twice.)
        """
        with self._lost("file transfer"):
            for t in transfers:
                with _mapped(t.path, t.nbytes, write=not t.send) as buf:
                    for i in range(0, buf.numel(), PIECE_BYTES):
                        piece = buf[i : i + PIECE_BYTES]
                        if t.send:
                            dist.send(piece, self.ranks[t.peer], self._pg, tag=t.tag)
                        else:
                            dist.recv(piece, self.ranks[t.peer], self._pg, tag=t.tag)
                        del piece  # the map closes once no tensor refers to it

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
    """One file going to (``send``) or coming from ``peer`` (a group rank), under ``tag``."""

    path: Path
    nbytes: int
    peer: int
    tag: int
    send: bool


@contextlib.contextmanager
def _mapped(path: Path, nbytes: int, write: bool) -> Iterator[torch.Tensor]:
    """The file as a uint8 tensor over a memory map (created at ``nbytes`` when writing)."""
    flags = os.O_RDWR | os.O_CREAT if write else os.O_RDONLY  # a spare file is overwritten
    fd = os.open(path, flags, 0o644)
    try:
        if write:
            os.ftruncate(fd, nbytes)
        if nbytes == 0:
            yield torch.empty(0, dtype=torch.uint8)
            return
        # Populated in one call: faulting a tmpfs file in page by page costs more than sending
        # it. Read-only when reading (the tensor is only ever sent from).
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE, prot=prot)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only: sent, never written
                tensor = torch.frombuffer(mm, dtype=torch.uint8)
            yield tensor
            del tensor
        finally:
            with contextlib.suppress(BufferError):
                mm.close()
    finally:
        os.close(fd)
