"""Read once, share on the host, for files on a local file system: the page cache is the buffer.

The exchange plan says which rank owns (reads and verifies) each unit of a chunk that several
ranks of one host need parts of. With files the kernel already keeps one copy of every page
read, shared by all processes of the host, so no buffer of our own and no step-by-step
hand-over between ranks is needed: every rank maps, once per file, the byte span of the units
it needs parts of; an owner verifies every checksum segment of its unit straight from the
mapping, copying its own rows of each segment right after hashing it (still in the processor's
cache), and every rank copies its parts straight out of the mapping. Nothing waits for another
rank, so reading, hashing and copying overlap fully across ranks and threads, and no byte is
copied twice.

A rank may copy a part before the owner has verified the unit: when the owner finds damage its
error fails the load on every rank (the caller's step gathers errors), as damage found in a
rank's own reads does; values already copied are never reported as loaded.

Bytes read: each unit once on the host (the owner's, counted in its report; through the
mapping, so the kernel's read-call counters do not see it). A rank that cannot map a file reads
its units' bytes into a scratch buffer instead (counted). Peak extra memory: the page tables of
the mapped spans (the pages are the page cache's own), kept until the exchange ends, and a
scratch buffer per thread only where mapping failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..config import Config
from ..format.dtypes import buffer_of
from ..planning.exchange_plan import ExchangePlan, Unit
from ..planning.load_plan import ReadItem
from ..storage.base import Storage
from .exchange import ExchangeStats
from .file_maps import FileMaps
from .read_chunks import ChunkRef, read_chunk_bytes
from .scratch import Scratch
from .unit_copy import copy_parts, verify_and_copy


def run_mapped_exchange(
    rank: int,
    storage: Storage,
    plan: ExchangePlan,
    needed: Sequence[ReadItem],
    config: Config,
    verify: bool,
    segment: int,
) -> ExchangeStats:
    """Fill this rank's exchanged items (``needed[i]`` for need ``i``); no collective."""
    tasks: list[Callable[[], tuple[int, int, int]]] = []
    scratch = Scratch()
    mine = plan.taken(rank)
    maps = FileMaps(storage, ((u.file, u.chunk.byte_offset + u.lo, u.hi - u.lo) for u in mine))
    for u in sorted(mine, key=lambda u: (u.file, u.chunk.byte_offset + u.lo)):
        if u.owner == rank:
            tasks.append(_owned(storage, maps, scratch, u, needed, rank, verify, segment))
        else:
            tasks.append(_shared(storage, maps, scratch, u, needed, rank))
    totals = [0, 0, 0]
    try:
        with ThreadPoolExecutor(config.io_threads, thread_name_prefix="unickpt-map") as pool:
            for counts in pool.map(lambda t: t(), tasks):
                totals = [a + b for a, b in zip(totals, counts)]
    finally:
        maps.close()
    return ExchangeStats(totals[0], totals[1], totals[2])


def _owned(
    storage: Storage,
    maps: FileMaps,
    scratch: Scratch,
    u: Unit,
    needed: Sequence[ReadItem],
    rank: int,
    verify: bool,
    segment: int,
) -> Callable[[], tuple[int, int, int]]:
    """Read and verify a unit this rank owns, copy its own parts; (read, placed, 0)."""

    def run() -> tuple[int, int, int]:
        size = u.hi - u.lo
        raw = maps.view(u.file, u.chunk.byte_offset + u.lo, u.hi - u.lo)
        if raw is None:
            raw = scratch.take(size)
            ref = ChunkRef(u.key, u.file, u.chunk)
            read_chunk_bytes(storage, ref, u.lo, raw, verify, segment)
            return size, copy_parts(raw, u, needed, rank), 0
        if verify and u.chunk.checksums:
            return size, verify_and_copy(raw, u, needed, rank, segment), 0
        return size, copy_parts(raw, u, needed, rank), 0

    return run


def _shared(
    storage: Storage,
    maps: FileMaps,
    scratch: Scratch,
    u: Unit,
    needed: Sequence[ReadItem],
    rank: int,
) -> Callable[[], tuple[int, int, int]]:
    """Copy this rank's parts of a unit another rank owns (and verifies) out of the page cache;
    (bytes read where it could not be mapped, placed, placed)."""

    def run() -> tuple[int, int, int]:
        raw = maps.view(u.file, u.chunk.byte_offset + u.lo, u.hi - u.lo)
        read = 0
        if raw is None:
            size = u.hi - u.lo
            raw = scratch.take(size)
            storage.read_into(u.file, u.chunk.byte_offset + u.lo, buffer_of(raw))
            read = size
        placed = copy_parts(raw, u, needed, rank)
        return read, placed, placed

    return run
