"""Read once, share on the host: the exchange of a resharded load, through shared memory.

This is the path of backends without a shared page cache (object stores, fsspec); files on a
local file system share through the page cache instead (:mod:`unickpt.engine.mapped`).

Every rank runs the same steps (the plan's rounds, plus one). In step ``k`` a rank copies its
parts of round ``k - 1`` out of the owners' buffers and reads (and verifies) the units it owns
in round ``k`` into its own buffer; then all ranks gather whether the step failed. Each owner
has two buffers in host shared memory and round ``k`` uses buffer ``k % 2``: the gather after
step ``k + 1`` is passed only once every rank finished copying round ``k``, so round ``k + 2``
may overwrite that buffer. When a step failed on any rank, every rank stops after that gather:
the ranks that failed raise, the others return None, and the caller's step raises the failing
ranks' errors on every rank.

Peak extra memory: two buffers of at most the plan's round bytes per owning rank, in shared
memory (files under ``/dev/shm``, removed as soon as every rank has mapped them).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..config import Config
from ..dist import Comm, RankFailure, failure_of, machine_id, node_name
from ..planning.exchange_plan import ExchangePlan, Need, RankNeeds, Unit
from ..planning.load_plan import ReadItem
from ..storage.base import Storage
from .read_chunks import ChunkRef, is_direct, local_read_bytes, read_chunk_bytes
from .unit_copy import copy_parts

SHM_DIR = "/dev/shm"
MAX_GATHERED_NEEDS = 200_000
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExchangeStats:
    """What an exchange did on this rank. ``shared`` is False when shared memory could not be
    set up on some rank: then no item was filled and the caller reads every item alone.
    ``bytes_received``: bytes that came over the process group."""

    bytes_read: int
    bytes_wanted: int
    bytes_from_peers: int
    shared: bool = True
    bytes_received: int = 0


def host_group(storage: Storage) -> str | None:
    """Ranks with the same group share buffers: one node (:func:`unickpt.dist.node_name`) on one
    machine (its boot id and ``/dev/shm``), one storage. Two nodes named apart on one machine
    share nothing through it: their ranks exchange over the process group."""
    machine = machine_id()
    try:
        st = os.stat(SHM_DIR)
        if not os.access(SHM_DIR, os.W_OK):
            return None
    except OSError:
        return None
    if machine is None:
        return None
    return f"{node_name()}|{machine}|{st.st_dev}:{st.st_ino}|{storage.location}"


def node_of_reads(storage: Storage) -> tuple[str, str | None]:
    """This rank's node (its name and machine) and the storage it reads, as the plan of reads
    shared across nodes groups ranks: None for files in memory, which no other node sees."""
    return f"{node_name()}|{machine_id()}", None if storage.in_memory else storage.location


def across_nodes(places: Sequence[tuple[str, str | None]], rank: int) -> bool:
    """Whether ranks of another node read the storage ``rank`` reads (``places``: every rank's
    :func:`node_of_reads`)."""
    node, source = places[rank]
    return source is not None and any(s == source and n != node for n, s in places)


def rank_needs(
    storage: Storage,
    items: Sequence[ReadItem],
    verify: bool,
    segment: int,
    world_size: int,
    across: bool = False,
    piece: int = 0,
) -> tuple[RankNeeds, list[ReadItem]]:
    """What this rank reports for the plans of shared reads (need ``i`` is item ``i`` of the
    returned list): with ``across`` (ranks of other nodes read the same storage) every item,
    for :func:`~unickpt.planning.node_plan.plan_node_reads`; otherwise only the items it would
    read more bytes for than it needs, for the host's exchange. Every rank receives every
    rank's needs, so a rank whose needs times the world size exceed ``MAX_GATHERED_NEEDS``
    reports fewer: only the host's, or none (large worlds, until needs are gathered per
    host). ``piece``: this rank's ``read_piece_bytes``, reported with them."""
    node, source = node_of_reads(storage)
    if not across:
        source = None
    needs, needed = _needs(items, verify, segment, source is not None)
    if len(needs) * world_size > MAX_GATHERED_NEEDS and source is not None:
        source = None
        needs, needed = _needs(items, verify, segment, False)
    if len(needs) * world_size > MAX_GATHERED_NEEDS:
        return RankNeeds(None, "", ()), []
    token = uuid.uuid4().hex
    return RankNeeds(host_group(storage), token, tuple(needs), node, source, piece), needed


def _needs(
    items: Sequence[ReadItem], verify: bool, segment: int, every: bool
) -> tuple[list[Need], list[ReadItem]]:
    """The needs of ``items``: every one with bytes (``every``), else those the host shares
    (read alone, they would cost more bytes than they hold; compressed ones are read alone)."""
    needs, needed = [], []
    for item in items:
        c = item.chunk
        nbytes = item.region.numel * item.dest.element_size()
        direct = is_direct(item)
        cost = local_read_bytes(item, verify, segment)
        host = not direct and c.compression is None and cost > nbytes
        if nbytes and (every or host):
            packed = c.compression is not None
            where = (item.key, item.file, c.byte_offset, item.region, cost, c.box, c.nbytes)
            needs.append(Need(*where, direct and not packed, packed, host))
            needed.append(item)
    return needs, needed


def run_exchange(
    comm: Comm,
    storage: Storage,
    plan: ExchangePlan,
    needed: Sequence[ReadItem],
    config: Config,
    verify: bool,
    segment: int,
) -> ExchangeStats | None:
    """Fill this rank's exchanged items (``needed[i]`` for need ``i``); None when another rank
    failed (that rank raises). When a rank cannot create or map the buffers (``/dev/shm`` full
    or not shared after all), every rank stops and reads alone (``shared`` is False)."""
    buffers = _Buffers(plan, comm.rank)
    taken = plan.taken(comm.rank)  # cannot raise here: the load's planning step checked it
    mine = [u for u in taken if any(p.rank == comm.rank for p in u.parts)]
    owned = [u for u in taken if u.owner == comm.rank]
    totals = [0, 0, 0]
    try:
        with ThreadPoolExecutor(config.io_threads, thread_name_prefix="unickpt-xchg") as pool:
            for step in range(plan.rounds + 1):
                failure: RankFailure | None = None
                caught: BaseException | None = None
                unavailable = False
                try:
                    if _set_up(buffers, step, {u.owner for u in mine}):
                        tasks = [_copier(buffers, u, needed, comm.rank) for u in mine
                                 if u.round == step - 1]  # fmt: skip
                        tasks += [_reader(storage, buffers, u, verify, segment) for u in owned
                                  if u.round == step]  # fmt: skip
                        for counts in pool.map(lambda t: t(), tasks):
                            totals = [a + b for a, b in zip(totals, counts)]
                    else:
                        unavailable = True
                except Exception as e:  # noqa: BLE001 - every failure is reported to every rank
                    failure, caught = failure_of(comm.rank, e), e
                gathered = comm.all_gather((failure, unavailable))
                if step >= 1:
                    buffers.unlink()
                if any(f is not None for f, _ in gathered):
                    if caught is not None:
                        raise caught
                    return None
                if any(u for _, u in gathered):
                    log.warning(
                        "shared memory for the load's exchange is unavailable on a rank "
                        "(/dev/shm full or not shared); every rank reads alone"
                    )
                    return ExchangeStats(totals[0], 0, 0, shared=False)
    finally:
        buffers.unlink()
    return ExchangeStats(totals[0], totals[1], totals[2])


def _set_up(buffers: _Buffers, step: int, owners: set[int]) -> bool:
    """Create this rank's buffers (step 0), map the others' (step 1); False if the host's shared
    memory refused."""
    try:
        if step == 0:
            buffers.create()
        if step == 1:
            buffers.open_peers(owners)
    except OSError as e:
        log.debug("exchange buffers unavailable: %s", e)
        return False
    return True


def _reader(
    storage: Storage, buffers: _Buffers, u: Unit, verify: bool, segment: int
) -> Callable[[], tuple[int, int, int]]:
    """Read and verify a unit this rank owns into its buffer; (bytes read, 0, 0)."""

    def run() -> tuple[int, int, int]:
        out = buffers.own[u.round % 2][u.offset : u.offset + u.hi - u.lo]
        read_chunk_bytes(storage, ChunkRef(u.key, u.file, u.chunk), u.lo, out, verify, segment)
        return u.hi - u.lo, 0, 0

    return run


def _copier(
    buffers: _Buffers, u: Unit, needed: Sequence[ReadItem], rank: int
) -> Callable[[], tuple[int, int, int]]:
    """Copy this rank's parts of a unit into place; (0, bytes placed, bytes from a peer)."""

    def run() -> tuple[int, int, int]:
        raw = buffers.of(u.owner, u.round % 2)[u.offset : u.offset + u.hi - u.lo]
        placed = copy_parts(raw, u, needed, rank)
        return 0, placed, placed if u.owner != rank else 0

    return run


class _Buffers:
    """This rank's two buffers (when it owns units) and the mapped buffers of other owners."""

    def __init__(self, plan: ExchangePlan, rank: int) -> None:
        self.plan = plan
        self.rank = rank
        self.own: list[torch.Tensor] = []
        self.peers: dict[tuple[int, int], torch.Tensor] = {}
        self.paths: list[str] = []

    def _path(self, owner: int, parity: int) -> str:
        return os.path.join(SHM_DIR, f"unickpt-load-{self.plan.tokens[owner]}-{parity}")

    def create(self) -> None:
        size = self.plan.buffer_bytes.get(self.rank, 0)
        if not size:
            return
        for parity in (0, 1):
            path = self._path(self.rank, parity)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self.paths.append(path)
            try:
                os.posix_fallocate(fd, 0, size)
                self.own.append(_mapped(fd, size))
            finally:
                os.close(fd)

    def open_peers(self, owners: set[int]) -> None:
        for owner in sorted(owners - {self.rank}):
            size = self.plan.buffer_bytes[owner]
            for parity in (0, 1):
                fd = os.open(self._path(owner, parity), os.O_RDWR)
                try:
                    self.peers[owner, parity] = _mapped(fd, size)
                finally:
                    os.close(fd)

    def of(self, owner: int, parity: int) -> torch.Tensor:
        return self.own[parity] if owner == self.rank else self.peers[owner, parity]

    def unlink(self) -> None:
        """Remove the files (mappings stay valid until the tensors are freed)."""
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.paths = []


def _mapped(fd: int, size: int) -> torch.Tensor:
    """The file's bytes as a uint8 tensor, mapped shared with its pages populated up front (one
    call instead of a page fault per 4 KiB while reading or copying)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return torch.frombuffer(mmap.mmap(fd, size, flags=flags), dtype=torch.uint8)
