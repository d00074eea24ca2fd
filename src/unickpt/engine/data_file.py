"""One data file, written as parts from parallel threads (or as a compressed stream).

:func:`~unickpt.engine.parts.plan_parts` cuts the rank's file into parts the backend can take.
Worker threads hash each part's chunk pieces and hand the part to the backend as a list of
buffers: views of the sources themselves (no copy) and zero padding. The file is completed
(durable) before :func:`write_file` returns, or aborted (nothing left) when anything fails.

With ``compress``, the chunks are compressed (:mod:`.compress`, per checksum segment, in file
order) on as many threads as this rank's share of the host's cores (at least ``io_threads``
where the cores allow), and the stored segments are appended to a stream of the file
(:meth:`~unickpt.storage.base.Storage.create_stream`) as they are done, back to back: the
writing overlaps the compressing.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from ..config import Config
from ..format.dtypes import buffer_of
from ..format.metadata import Compression
from ..planning.save_plan import CHUNK_ALIGN, WriteItem
from ..storage.base import Storage, StreamHandle, WriteHandle
from .checksum import segment_digests
from .compress import Packed, Segment, chunk_entry, pack_segment, segment_starts
from .memcpy import copy_threads
from .parts import Part, PartRules, plan_parts
from .sources import ItemSource, StagedParts
from .timeline import Timeline, timed

_ZEROS = memoryview(bytes(4096))


@dataclass(frozen=True)
class WriteResult:
    """The checksums of every item this rank wrote, in item order. A compressed write also
    gives where each item lies and how it is compressed (``placed``, in item order)."""

    checksums: tuple[tuple[str, ...], ...]
    nbytes: int
    placed: tuple[tuple[int, Compression | None], ...] = ()
    raw_checksums: tuple[tuple[str, ...], ...] = ()
    """With ``placed``: the checksums of each item's raw bytes where it was compressed."""

    def placements(self, items: Sequence[WriteItem]) -> list[tuple[int, Compression | None]]:
        """Each item's byte offset in the file and its compression (None: stored plainly)."""
        return list(self.placed) if self.placed else [(i.byte_offset, None) for i in items]


def write_file(
    storage: Storage,
    name: str,
    items: Sequence[WriteItem],
    sources: Sequence[ItemSource],
    config: Config,
    progress: Callable[[int, int], None] | None = None,
    known: Sequence[tuple[str, ...]] | None = None,
    alongside: Callable[[WriteResult], None] | None = None,
    compress: bool | Sequence[bool] = False,
    stager: StagedParts | None = None,
    timeline: Timeline | None = None,
) -> WriteResult:
    """Write ``items`` from ``sources`` into ``name``; durable on return.

    ``progress(bytes_written, bytes_total)`` is called as each part lands. ``known``, when
    given, holds the items' checksums computed already (nothing is hashed again).
    ``alongside(result)``, when given, runs once every part is written, while the file is
    completed (the rank's index is written then, not after: on S3 its PUT overlaps the
    completion of the upload); when either fails the file is aborted and the error raised.
    With ``compress`` (True, or one flag per item), items are compressed first and laid out
    anew (``known`` is not used: the checksums cover the stored bytes); the result's
    ``placed`` says where each lies. With ``stager``, the parts' bytes come from it (copied
    from the sources through a bounded ring, see :mod:`.ring`), not from the sources.
    ``timeline``, when given, gets the seconds of each phase (see :mod:`.timeline`).
    """
    flags = [compress] * len(items) if isinstance(compress, bool) else list(compress)
    if any(flags):
        if stager is not None:
            raise AssertionError("a staged write is not compressed")
        return _write_compressed(
            storage, name, items, sources, config, progress, alongside, flags, timeline
        )
    return _write_items(
        storage, name, items, sources, config, progress, known, alongside, stager, timeline
    )


def _write_compressed(
    storage: Storage,
    name: str,
    items: Sequence[WriteItem],
    sources: Sequence[ItemSource],
    config: Config,
    progress: Callable[[int, int], None] | None,
    alongside: Callable[[WriteResult], None] | None,
    flags: Sequence[bool],
    timeline: Timeline | None = None,
) -> WriteResult:
    """Compress every item whose flag is set, segment by segment on the compressing threads,
    while the stored segments are appended to the file in order, back to back (each chunk at
    the next multiple of ``CHUNK_ALIGN``): the save takes about the longer of compressing and
    writing, not their sum. The checksums cover the stored bytes."""
    raws = [s.contiguous_bytes().reshape(-1).numpy() for s in sources]
    widths = [s.view.element_size() if f else 0 for s, f in zip(sources, flags)]
    cores = len(os.sched_getaffinity(0))  # compressing is bound by the cores, not the I/O
    threads = copy_threads(max(cores, config.io_threads))
    t0 = time.perf_counter()
    handle = storage.create_stream(name)
    try:
        stream = _CompressedStream(handle, config.segment_bytes, threads, progress, timeline)
        entries, offsets = stream.write(raws, widths)
        placed = tuple((at, p.compression) for at, p in zip(offsets, entries))
        raw = tuple(p.raw_checksums for p in entries)
        result = WriteResult(tuple(p.checksums for p in entries), handle.nbytes, placed, raw)
        if timeline is not None:
            timeline.add("file", time.perf_counter() - t0)
        with timed(timeline, "complete"):
            _complete(handle, result, alongside)
    except BaseException:
        handle.abort()
        raise
    return result


class _CompressedStream:
    """Chunks compressed segment by segment on ``threads`` threads in file order, each
    stored segment appended to ``handle`` as soon as it and all before it are done. At most
    ``2 * threads`` segments are being compressed or wait their turn, so the compressed bytes
    held are bounded by ``2 * threads * segment`` (the raw bytes are the sources' own)."""

    def __init__(
        self,
        handle: StreamHandle,
        segment: int,
        threads: int,
        progress: Callable[[int, int], None] | None,
        timeline: Timeline | None,
    ) -> None:
        self.handle, self.segment, self.threads = handle, segment, threads
        self.progress, self.timeline = progress, timeline

    def write(
        self, raws: Sequence[np.ndarray], widths: Sequence[int]
    ) -> tuple[list[Packed], list[int]]:
        """Write every chunk; each one's index entry and byte offset in the file."""
        segments: list[list[Segment]] = [[] for _ in raws]
        offsets: list[int] = []
        pending: deque[tuple[int, Future[Segment]]] = deque()
        total, done = sum(len(r) for r in raws), 0
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="unickpt-compress")
        try:
            for i, (raw, width) in enumerate(zip(raws, widths)):
                for start in segment_starts(len(raw), self.segment):
                    while len(pending) >= 2 * self.threads:
                        done += self._append(pending.popleft(), segments, offsets)
                        self._report(done, total)
                    piece = raw[start : start + self.segment]
                    pending.append((i, pool.submit(self._pack, piece, width)))
            while pending:
                done += self._append(pending.popleft(), segments, offsets)
                self._report(done, total)
        finally:
            pool.shutdown(cancel_futures=True)
        return [chunk_entry(s, w) for s, w in zip(segments, widths)], offsets

    def _pack(self, piece: np.ndarray, width: int) -> Segment:
        with timed(self.timeline, "compress"):
            return pack_segment(piece, width)

    def _append(
        self,
        job: tuple[int, Future[Segment]],
        segments: list[list[Segment]],
        offsets: list[int],
    ) -> int:
        """Append the next stored segment (after the padding that aligns its chunk, when it
        is the chunk's first); its raw size."""
        i, fut = job
        found = fut.result()
        buffers = []
        if not segments[i]:
            pad = -self.handle.nbytes % CHUNK_ALIGN
            buffers += _zeros(pad)
            offsets.append(self.handle.nbytes + pad)
        segments[i].append(found)
        buffers.append(memoryview(found.stored))  # type: ignore[arg-type]
        with timed(self.timeline, "write"):
            self.handle.append(buffers)
        return found.raw_nbytes

    def _report(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)


def _write_items(
    storage: Storage,
    name: str,
    items: Sequence[WriteItem],
    sources: Sequence[ItemSource],
    config: Config,
    progress: Callable[[int, int], None] | None,
    known: Sequence[tuple[str, ...]] | None,
    alongside: Callable[[WriteResult], None] | None,
    stager: StagedParts | None = None,
    timeline: Timeline | None = None,
) -> WriteResult:
    """:func:`write_file` of items as they are stored."""
    t0 = time.perf_counter()
    target, small = config.window_bytes, config.small_chunk_bytes
    if stager is not None:  # parts a few of which fit in the ring: chunks above one are cut
        target = stager.part_bytes(target, config.segment_bytes)
        small = min(small, target)
    rules = PartRules(
        target_bytes=target,
        segment_bytes=config.segment_bytes,
        small_bytes=small,
        min_bytes=storage.min_part_bytes,
        max_parts=storage.max_parts,
        max_bytes=storage.max_part_bytes,
    )
    extents = [(i.byte_offset, i.nbytes) for i in items]
    splittable = [True] * len(items) if stager else [s.direct for s in sources]
    parts = plan_parts(extents, splittable, rules)
    total = sum(p.nbytes for p in parts)
    handle = storage.create(name, [p.nbytes for p in parts])
    if stager is not None:
        stager.start(parts)
    digests: dict[tuple[int, int], list[str]] = {}
    pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="unickpt-write")
    try:
        futures = [
            pool.submit(
                _write_part, handle, part, sources, config.segment_bytes, known, stager, timeline
            )
            for part in parts
        ]
        done = 0
        for part, fut in zip(parts, futures):
            digests.update(_result(fut, pool, handle))
            done += part.nbytes
            if progress is not None:
                progress(done, total)
        pool.shutdown()
        result = WriteResult(_ordered(digests, items, config.segment_bytes), total)
        if timeline is not None:
            timeline.add("file", time.perf_counter() - t0)
        with timed(timeline, "complete"):
            _complete(handle, result, alongside)
    except BaseException:
        if stager is not None:
            stager.stop()  # parts waiting for their bytes return before the pool is joined
        handle.abort()
        raise
    finally:
        pool.shutdown(cancel_futures=True)
    return result


def _complete(
    handle: WriteHandle | StreamHandle,
    result: WriteResult,
    alongside: Callable[[WriteResult], None] | None,
) -> None:
    """Complete the file, with ``alongside(result)`` running meanwhile in another thread;
    both are done when this returns or raises (the completion's error first)."""
    if alongside is None:
        handle.complete()
        return
    with ThreadPoolExecutor(1, thread_name_prefix="unickpt-alongside") as side:
        fut = side.submit(alongside, result)
        try:
            handle.complete()
        except BaseException:
            wait([fut])
            raise
        fut.result()


def _result(
    fut: Future[dict[tuple[int, int], list[str]]], pool: ThreadPoolExecutor, handle: WriteHandle
) -> dict[tuple[int, int], list[str]]:
    """A part's digests; on its failure, stop the parts not started and abort the file first,
    so that parts waiting their turn (sequential backends) return instead of waiting on."""
    try:
        return fut.result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        handle.abort()
        raise


def _write_part(
    handle: WriteHandle,
    part: Part,
    sources: Sequence[ItemSource],
    segment: int,
    known: Sequence[tuple[str, ...]] | None = None,
    stager: StagedParts | None = None,
    timeline: Timeline | None = None,
) -> dict[tuple[int, int], list[str]]:
    """Hash the part's chunk pieces (unless ``known``) and write it from views of its sources
    (or of the bytes ``stager`` staged for it)."""
    staged = stager.buffers(part) if stager is not None else None
    out: dict[tuple[int, int], list[str]] = {}
    buffers: list[memoryview] = []
    for n, span in enumerate(part.spans):
        if span.item is None:
            buffers += _zeros(span.nbytes)
            continue
        if staged is not None:
            mv = staged[n]
            assert mv is not None
        else:
            source = sources[span.item]
            size = source.view.numel() * source.view.element_size()
            whole = span.start == 0 and span.nbytes == size
            mv = buffer_of(source.byte_range(span.start, span.nbytes, whole))
        if known is None:
            with timed(timeline, "hash"):
                out[(span.item, span.start)] = segment_digests(mv, segment)
        else:
            first = span.start // segment
            out[(span.item, span.start)] = list(
                known[span.item][first : first + _count(mv, segment)]
            )
        buffers.append(mv)
    with timed(timeline, "write"):
        handle.write_part(part.index, buffers)
    if stager is not None:
        stager.release(part)
    return out


def _count(mv: memoryview, segment: int) -> int:
    return max(1, -(-len(mv) // segment))


def _zeros(nbytes: int) -> list[memoryview]:
    step = len(_ZEROS)
    return [_ZEROS[: min(step, nbytes - i)] for i in range(0, nbytes, step)]


def _ordered(
    digests: dict[tuple[int, int], list[str]], items: Sequence[WriteItem], segment: int
) -> tuple[tuple[str, ...], ...]:
    by_item: list[list[tuple[int, list[str]]]] = [[] for _ in items]
    for (i, start), values in digests.items():
        by_item[i].append((start, values))
    out = []
    for i, parts in enumerate(by_item):
        flat = [d for _, values in sorted(parts) for d in values]
        expected = max(1, math.ceil(items[i].nbytes / segment))
        if len(flat) != expected:
            raise AssertionError(f"item {i}: {len(flat)} digests, expected {expected}")
        out.append(tuple(flat))
    return tuple(out)
