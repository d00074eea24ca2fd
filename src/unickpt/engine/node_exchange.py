"""Read once across nodes: each fetch read by one rank, sent over the process group to the others.

The plan (:mod:`unickpt.planning.node_plan`) names, for every byte range that ranks of several
nodes load, the rank that reads it (its *owner*) and the ranks that receive it, in rounds. Every
rank runs every round, then all ranks gather whether it failed. Within a round nothing waits for
another rank's progress: each rank posts the receives of the round's fetches it needs (gloo
point-to-point messages on the load's process group: the fetch's bytes, then a status byte),
reads the fetches it owns on its I/O threads and sends each as soon as it is read and verified,
then places what it received as it arrives. A fetch that its owner could not read (or found
damaged) is sent all the same, with a failed status: its receivers leave it, the owner raises at
the round's gather, and every rank stops there (the ranks that failed raise, the others return
None, and the caller's step raises the failing ranks' errors on every rank). The buffers of the
next round are made before that gather, so a rank that cannot make them stops every rank before
anything of the round moves.

Every rank verifies what it uses: the owner the fetch it read, each receiver the fetch it
received, against the checksums of the chunk's index it read itself (damage a receiver finds
fails the load on every rank at the round's gather). A fetch of one whole chunk that lands in
contiguous CPU memory is read (owner) or received (receiver) straight into the destination and
verified there; any other goes through a buffer, from which each rank verifies and copies its
parts (:mod:`unickpt.engine.unit_copy`), or decodes it first when the chunk is compressed.

Peak extra memory: the buffers of the fetches of two rounds this rank reads or receives (at most
twice the plan's round bytes, unless one fetch is larger); none for fetches straight into place.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed

import torch

from ..config import Config
from ..dist import Comm, RankFailure, failure_of
from ..format.dtypes import buffer_of, byte_view
from ..planning.exchange_plan import Unit
from ..planning.load_plan import ReadItem
from ..planning.node_plan import Fetch, NodePlan
from ..storage.base import Storage
from .compress import packed_span, unpack_checked
from .exchange import ExchangeStats
from .read_chunks import ChunkRef, check_segments, is_direct
from .unit_copy import copy_parts, verify_and_copy

Counts = tuple[int, int, int]  # bytes read, bytes placed, bytes received


def run_node_exchange(
    comm: Comm,
    storage: Storage,
    plan: NodePlan,
    needed: Sequence[ReadItem],
    config: Config,
    verify: bool,
    segment: int,
) -> ExchangeStats | None:
    """Fill this rank's items the plan serves (``needed[i]`` for need ``i``); None when another
    rank failed (that rank raises)."""
    me = comm.rank
    rounds: dict[int, list[Fetch]] = {}
    for f in plan.of(me):
        rounds.setdefault(f.round, []).append(f)
    run = _Run(comm, storage, needed, verify, segment, plan)
    totals = [0, 0, 0]
    targets: dict[int, torch.Tensor] = {}
    with ThreadPoolExecutor(config.io_threads, thread_name_prefix="unickpt-fetch") as pool:
        for step in range(plan.rounds + 1):
            failure: RankFailure | None = None
            caught: BaseException | None = None
            try:
                if step:  # round step - 1, its buffers made before the last gather
                    for counts in run.round(pool, rounds.get(step - 1, []), targets):
                        totals = [a + b for a, b in zip(totals, counts)]
                targets = {id(f): run.target(f) for f in rounds.get(step, [])}
            except Exception as e:  # noqa: BLE001 - every failure is reported to every rank
                failure, caught = failure_of(me, e), e
            gathered = comm.all_gather(failure)
            if any(f is not None for f in gathered):
                if caught is not None:
                    raise caught
                return None
    return ExchangeStats(totals[0], totals[1], 0, bytes_received=totals[2])


class _Run:
    """One rank's part of the exchange."""

    def __init__(
        self,
        comm: Comm,
        storage: Storage,
        needed: Sequence[ReadItem],
        verify: bool,
        segment: int,
        plan: NodePlan,
    ) -> None:
        self.comm = comm
        self.storage = storage
        self.needed = needed
        self.verify = verify
        self.segment = segment
        self.tags = {id(f): 2 * i for i, f in enumerate(plan.fetches)}  # bytes; status: + 1

    def round(
        self, pool: ThreadPoolExecutor, fetches: list[Fetch], targets: dict[int, torch.Tensor]
    ) -> list[Counts]:
        """Receive, read, send and place this rank's fetches of one round (their bytes land in
        ``targets``); every started transfer and task is waited for, then the first error is
        raised. Only this thread calls the process group."""
        me, comm = self.comm.rank, self.comm
        errors: list[BaseException] = []
        receives = []
        for f in fetches:
            if f.owner != me:
                status = torch.zeros(1, dtype=torch.uint8)
                tag = self.tags[id(f)]
                data = comm.irecv(targets[id(f)], f.owner, tag)
                receives.append((f, data, status, comm.irecv(status, f.owner, tag + 1)))
        reads = {pool.submit(self._read, f, targets[id(f)]): f for f in fetches if f.owner == me}
        tasks: list[Future[Counts]] = []
        sends = []
        for done in as_completed(reads):
            f = reads[done]
            ok = done.exception() is None
            tasks.append(done)
            status = torch.tensor([1 if ok else 0], dtype=torch.uint8)
            for r in f.receivers:  # sent even when the read failed: the receivers wait for it
                tag = self.tags[id(f)]
                sends += [comm.isend(targets[id(f)], r, tag), comm.isend(status, r, tag + 1)]
        for f, data, status, flag in receives:
            try:
                comm.wait(data, "receive")
                comm.wait(flag, "receive")
                if status.item():  # else its owner failed, and says so at the gather
                    tasks.append(pool.submit(self._place, f, targets[id(f)], True))
            except Exception as e:  # noqa: BLE001 - raised below, after the others
                errors.append(e)
        for work in sends:
            try:
                comm.wait(work, "send")
            except Exception as e:  # noqa: BLE001 - raised below, after the others
                errors.append(e)
        counts = []
        for task in tasks:
            try:
                counts.append(task.result())
            except Exception as e:  # noqa: BLE001 - raised below, after the others
                errors.append(e)
        if errors:
            raise errors[0]
        return counts

    def _read(self, f: Fetch, into: torch.Tensor) -> Counts:
        """Read a fetch this rank owns into ``into``, verify it and place this rank's parts."""
        start, stop = self._span(f)
        self.storage.read_into(f.file, start, buffer_of(into))
        _, placed, _ = self._place(f, into, False)
        return stop - start, placed, 0

    def _span(self, f: Fetch) -> tuple[int, int]:
        """The file bytes the fetch moves (a compressed unit's: its stored segments)."""
        if not f.compressed:
            return f.start, f.stop
        u = f.units[0]
        lo, hi = packed_span(u.chunk, u.lo, u.hi, self.segment)
        return u.chunk.byte_offset + lo, u.chunk.byte_offset + hi

    def target(self, f: Fetch) -> torch.Tensor:
        """Where the fetch's bytes land on this rank: the destination itself for one whole
        chunk into contiguous CPU memory, else a buffer."""
        item = self._direct(f)
        if item is not None:
            u = f.units[0]
            return byte_view(item.dest).reshape(-1)[u.lo : u.hi]
        start, stop = self._span(f)
        return torch.empty(stop - start, dtype=torch.uint8)

    def _direct(self, f: Fetch) -> ReadItem | None:
        """This rank's item that the fetch fills byte for byte, if any."""
        if f.compressed or len(f.units) != 1:
            return None
        mine = [p for p in f.units[0].parts if p.rank == self.comm.rank]
        if len(mine) != 1:
            return None
        item = self.needed[mine[0].need]
        return item if is_direct(item) else None

    def _place(self, f: Fetch, data: torch.Tensor, received: bool) -> Counts:
        """Verify this rank's units of the fetch's bytes ``data`` and copy its parts; (0,
        bytes placed, bytes received)."""
        me = self.comm.rank
        placed = 0
        for u in f.units:
            if not any(p.rank == me for p in u.parts):
                continue
            placed += self._unit(f, u, data)
        return 0, placed, data.numel() if received else 0

    def _unit(self, f: Fetch, u: Unit, data: torch.Tensor) -> int:
        me, seg = self.comm.rank, self.segment
        check = self.verify and bool(u.chunk.checksums)
        ref = ChunkRef(u.key, u.file, u.chunk)
        if f.compressed:
            raw = torch.empty(u.hi - u.lo, dtype=torch.uint8)
            unpack_checked(data.numpy(), u.file, u.key, u.chunk, u.lo, raw.numpy(), check, seg)
            return copy_parts(raw, u, self.needed, me)
        raw = data[u.offset : u.offset + u.hi - u.lo]
        if self._direct(f) is not None:  # the bytes are in place
            if check:
                check_segments(ref, u.lo, raw, seg)
            return raw.numel()
        if check:
            return verify_and_copy(raw, u, self.needed, me, seg)
        return copy_parts(raw, u, self.needed, me)
