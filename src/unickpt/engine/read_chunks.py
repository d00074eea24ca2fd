"""The read path: parallel positional reads, straight into the destination when it can be.

A read item whose region is a whole chunk and whose destination is contiguous CPU memory is
read directly into the destination; from files that live in memory (a tmpfs, as the memory
tier's node folders) it is copied out of a map of the file instead, one checksum segment at a
time, each hashed right after its copy (a read of a tmpfs file goes through the kernel one 4 KiB
page at a time, which costs more than the copy). Otherwise only the byte runs of the region
are read (with verification on: the checksum segments that hold them) into a small buffer and
copied into place. Large regions are cut into pieces of about ``read_piece_bytes`` (whole
checksum segments of the checkpoint) so memory stays bounded. Small whole chunks that lie next
to each other in a file (the tensors of norms, biases, optimizer steps) are read together, in
one read of their span (at most ``BATCH_SPAN_BYTES``), each verified and copied into place: one
read per tensor costs far more than the bytes. From memory, reads are copies bound by the
cores: they run on at most this rank's share of the host's cores. Peak extra memory per thread:
a batch's span (a buffer kept for the load, at most ``BATCH_SPAN_BYTES``) and the span of a
region that is not a whole chunk (at most a piece); maps of in-memory files take page tables
only (their pages are the file's).

Compressed chunks (:mod:`.compress`) are read as the stored segments that hold the bytes
wanted, each verified, then decoded: never batched, never copied out of maps, a region of one
always read as a span of whole segments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ..config import Config
from ..format.dtypes import buffer_of, byte_view, itemsize
from ..layouts.boxes import contiguous_runs, row_major_strides, split_box
from ..planning.exchange_plan import flat_span
from ..planning.load_plan import ReadItem
from ..storage.base import Storage
from .checksum import ChunkRef, check_buffer
from .compress import read_packed
from .file_maps import FileMaps
from .memcpy import copy_elements, copy_threads
from .scratch import Scratch

_SMALL_RUN_BYTES = 64 * 1024
_MANY_RUNS = 16
SMALL_CHUNK_BYTES = 64 * 1024  # whole chunks below this are read together with their neighbours
BATCH_GAP_BYTES = 64  # the padding between chunks in a file (save_plan.CHUNK_ALIGN)
BATCH_SPAN_BYTES = 4 << 20  # one read of small chunks spans at most this (a buffer per thread)
MAPPED_COPY_BYTES = 1 << 20  # ranges of in-memory files from this size are copied out of a map


@dataclass(frozen=True)
class ReadStats:
    bytes_read: int
    bytes_wanted: int


def execute_reads(
    storage: Storage,
    items: Sequence[ReadItem],
    config: Config,
    verify: bool,
    segment_bytes: int,
) -> ReadStats:
    """Fill every item's destination. Raises CheckpointCorruptError on damage.

    ``segment_bytes`` is the checksum segment the checkpoint was written with.
    """
    piece_bytes = aligned_piece_bytes(config.read_piece_bytes, segment_bytes)
    pieces = [p for item in items for p in _split(item, piece_bytes)]
    pieces.sort(key=lambda it: (it.file, it.chunk.byte_offset))
    ranges = [t for p in pieces for t in _tasks(p, piece_bytes)]
    maps = _maps_of(storage, ranges)
    reader = _Reader(storage, segment_bytes, verify, maps)
    tasks = _batched(reader, ranges, min(piece_bytes, BATCH_SPAN_BYTES))
    # From memory, reads are copies: as many threads as this rank's share of the cores.
    threads = copy_threads(config.io_threads) if storage.in_memory else config.io_threads
    try:
        if len(tasks) <= 1 or threads == 1:
            read = sum(task() for task in tasks)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="unickpt-read") as pool:
                read = sum(pool.map(lambda task: task(), tasks))
    finally:
        if maps is not None:
            maps.close()
    wanted = sum(p.region.numel * p.dest.element_size() for p in pieces)
    return ReadStats(read, wanted)


def aligned_piece_bytes(piece_bytes: int, segment_bytes: int) -> int:
    """The reader's piece, cut to whole segments of the checkpoint being read (whose segment
    may differ from this process's config), so that every piece is verified on its own."""
    return max(segment_bytes, piece_bytes // segment_bytes * segment_bytes)


def _maps_of(storage: Storage, tasks: list[tuple[ReadItem, int, int]]) -> FileMaps | None:
    """Maps of the files whose whole chunks the tasks copy, when the files live in memory:
    there a copy out of a map (then each segment hashed while in cache) beats a read, which
    goes through the kernel one 4 KiB page at a time."""
    if not (storage.in_memory and storage.maps_files):
        return None
    ranges = [
        (item.file, item.chunk.byte_offset + a, b - a)
        for item, a, b in tasks
        if a >= 0 and _copied_from_map(a, b) and item.chunk.compression is None
    ]
    return FileMaps(storage, ranges) if ranges else None


def _copied_from_map(start: int, stop: int) -> bool:
    """Whether chunk bytes ``[start, stop)`` of a file in memory are copied out of a map (the
    same answer when the maps are made and when they are used)."""
    return stop - start >= MAPPED_COPY_BYTES


def _tasks(item: ReadItem, piece_bytes: int) -> list[tuple[ReadItem, int, int]]:
    """Direct items become byte ranges of ``piece_bytes``; others one task each."""
    if not is_direct(item):
        return [(item, -1, -1)]
    n = item.chunk.nbytes
    return [(item, a, min(a + piece_bytes, n)) for a in range(0, n, piece_bytes)]


def _batched(
    reader: _Reader, tasks: list[tuple[ReadItem, int, int]], span_bytes: int
) -> list[Callable[[], int]]:
    """The tasks (sorted by file and offset) as calls of ``reader``: runs of small whole chunks
    next to each other in one file (at most ``BATCH_GAP_BYTES`` apart, spanning at most
    ``span_bytes``) as one batch each, every other task alone."""
    out: list[Callable[[], int]] = []
    batch: list[ReadItem] = []

    def flush() -> None:
        if len(batch) == 1:
            out.append(partial(reader.run, batch[0], 0, batch[0].chunk.nbytes))
        elif batch:
            out.append(partial(reader.run_batch, tuple(batch)))
        batch.clear()

    for item, start, stop in tasks:
        n = item.chunk.nbytes
        alone = n > SMALL_CHUNK_BYTES or item.chunk.compression is not None
        if start < 0 or alone or (start, stop) != (0, n):
            flush()
            out.append(partial(reader.run, item, start, stop))
            continue
        if batch:
            first, last = batch[0].chunk, batch[-1].chunk
            gap = item.chunk.byte_offset - (last.byte_offset + last.nbytes)
            span = item.chunk.byte_offset + n - first.byte_offset
            if item.file != batch[0].file or not 0 <= gap <= BATCH_GAP_BYTES or span > span_bytes:
                flush()
        batch.append(item)
    flush()
    return out


def _split(item: ReadItem, max_bytes: int) -> list[ReadItem]:
    """Cut an item whose region exceeds ``max_bytes`` along its leading dimensions."""
    size = item.dest.element_size()
    if item.region.numel * size <= max_bytes or is_direct(item):
        return [item]
    return [
        ReadItem(item.key, item.file, item.chunk, sub, item.dest[sub.relative_to(item.region)])
        for sub in split_box(item.region, max(1, max_bytes // size))
    ]


def read_chunk_bytes(
    storage: Storage, ref: ChunkRef, start: int, out: torch.Tensor, verify: bool, segment: int
) -> None:
    """Read bytes ``[start, start + len(out))`` of a chunk into the uint8 tensor ``out``; with
    ``verify``, ``start`` is segment-aligned and every segment's checksum is checked."""
    if ref.chunk.compression is not None:
        read_packed(storage, ref.file, ref.key, ref.chunk, start, out.numpy(), verify, segment)
        return
    base = ref.chunk.byte_offset + start
    if verify and ref.chunk.checksums and storage.cheap_reads:
        for pos in range(0, out.numel(), segment):  # checked while still in cache
            piece = out[pos : pos + segment]
            storage.read_into(ref.file, base + pos, buffer_of(piece))
            check_segments(ref, start + pos, piece, segment)
        return
    storage.read_into(ref.file, base, buffer_of(out))
    if verify and ref.chunk.checksums:
        check_segments(ref, start, out, segment)


def copy_chunk_bytes(
    ref: ChunkRef, start: int, src: torch.Tensor, out: torch.Tensor, verify: bool, segment: int
) -> None:
    """Copy chunk bytes ``[start, start + len(out))`` from ``src`` (a map of them) into the
    uint8 tensor ``out``; with ``verify``, ``start`` is segment-aligned and every segment is
    checked right after its copy, while it is still in the processor's cache."""
    check = verify and bool(ref.chunk.checksums)
    dst, raw = out.numpy(), src.numpy()
    step = segment if check else max(1, len(dst))
    for pos in range(0, len(dst), step):
        piece = dst[pos : pos + step]
        np.copyto(piece, raw[pos : pos + step])
        if check:
            check_buffer(ref, start + pos, memoryview(piece), segment)  # type: ignore[arg-type]


def check_segments(ref: ChunkRef, start: int, data: torch.Tensor, seg: int) -> None:
    """Raise CheckpointCorruptError unless every checksum segment of ``data`` (bytes ``[start,
    start + len(data))`` of the chunk, ``start`` segment-aligned) matches the index."""
    check_buffer(ref, start, buffer_of(data), seg)


def region_read(item: ReadItem, verify: bool, segment: int) -> tuple[str, int, int]:
    """How the reader reads a region of a chunk alone: ``("span", lo, hi)`` (one read of chunk
    bytes ``[lo, hi)``, whole segments when verifying) or ``("runs", first, end)``."""
    size = item.dest.element_size()
    first, end = flat_span(item.chunk, item.region)
    if (verify and item.chunk.checksums) or item.chunk.compression is not None:
        lo = first * size // segment * segment
        hi = min(math.ceil(end * size / segment) * segment, item.chunk.nbytes)
        return "span", lo, hi
    starts, run = contiguous_runs(item.chunk.box, item.region)
    if len(starts) > _MANY_RUNS and run * size < _SMALL_RUN_BYTES:
        return "span", first * size, end * size
    return "runs", first * size, end * size


def local_read_bytes(item: ReadItem, verify: bool, segment: int) -> int:
    """Bytes the reader reads to fill ``item`` on its own."""
    if is_direct(item):
        return item.chunk.nbytes
    how, lo, hi = region_read(item, verify, segment)
    return hi - lo if how == "span" else item.region.numel * item.dest.element_size()


def is_direct(item: ReadItem) -> bool:
    return (
        item.region == item.chunk.box
        and item.dest.device.type == "cpu"
        and item.dest.is_contiguous()
    )


class _Reader:
    def __init__(
        self, storage: Storage, segment: int, verify: bool, maps: FileMaps | None = None
    ) -> None:
        self.storage = storage
        self.segment = segment
        self.verify = verify
        self.maps = maps
        self.scratch = Scratch()

    def run(self, item: ReadItem, start: int, stop: int) -> int:
        if start < 0:
            return self._read_region(item)
        out = byte_view(item.dest)[start:stop]
        src = self._mapped(item, start, stop)
        if src is None:
            self._read_verified(item, start, out)
        else:
            ref = ChunkRef(item.key, item.file, item.chunk)
            copy_chunk_bytes(ref, start, src, out, self.verify, self.segment)
        return stop - start

    def _mapped(self, item: ReadItem, start: int, stop: int) -> torch.Tensor | None:
        if self.maps is None or not _copied_from_map(start, stop) or item.chunk.compression:
            return None
        return self.maps.view(item.file, item.chunk.byte_offset + start, stop - start)

    def run_batch(self, items: Sequence[ReadItem]) -> int:
        """Read whole small chunks of one file, in file order, with one read of their span;
        verify each and copy it into its destination."""
        lo = items[0].chunk.byte_offset
        hi = items[-1].chunk.byte_offset + items[-1].chunk.nbytes
        span = self.scratch.take(hi - lo)
        self.storage.read_into(items[0].file, lo, buffer_of(span))
        for item in items:
            a = item.chunk.byte_offset - lo
            data = span[a : a + item.chunk.nbytes]
            if self.verify and item.chunk.checksums:
                ref = ChunkRef(item.key, item.file, item.chunk)
                check_segments(ref, 0, data, self.segment)
            copy_elements(byte_view(item.dest), data)
        return hi - lo

    def _read_verified(self, item: ReadItem, start: int, out: torch.Tensor) -> None:
        """Read chunk bytes ``[start, start + len(out))`` (segment-aligned when verifying)."""
        read_chunk_bytes(
            self.storage,
            ChunkRef(item.key, item.file, item.chunk),
            start,
            out,
            self.verify,
            self.segment,
        )

    def _read_region(self, item: ReadItem) -> int:
        how, lo, hi = region_read(item, self.verify, self.segment)
        if how == "span":
            return self._read_span(item, lo, hi)
        starts, run = contiguous_runs(item.chunk.box, item.region)
        return self._read_runs(item, [int(s) for s in starts], run * item.dest.element_size())

    def _read_span(self, item: ReadItem, lo: int, hi: int) -> int:
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        self._read_verified(item, lo, buf)
        typed = buf.view(item.dest.dtype)
        src = torch.as_strided(
            typed,
            item.region.lengths,
            row_major_strides(item.chunk.lengths),
            flat_span(item.chunk, item.region)[0] - lo // item.dest.element_size(),
        )
        item.dest.copy_(src)
        return hi - lo

    def _read_runs(self, item: ReadItem, starts: Sequence[int], run_bytes: int) -> int:
        size = item.dest.element_size()
        direct = item.dest.device.type == "cpu" and item.dest.is_contiguous()
        target = item.dest if direct else torch.empty(item.region.lengths, dtype=item.dest.dtype)
        out = byte_view(target)
        base = item.chunk.byte_offset
        for i, s in enumerate(starts):
            part = out[i * run_bytes : (i + 1) * run_bytes]
            self.storage.read_into(item.file, base + int(s) * size, buffer_of(part))
        if not direct:
            item.dest.copy_(target)
        return len(starts) * run_bytes


__all__ = ["ReadStats", "execute_reads", "itemsize", "split_box"]
