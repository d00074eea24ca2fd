"""The write path: one data file per writing rank, filled by parallel positional writes.

The rank's :class:`WriteItem` list is cut into :class:`WriteTask` s: large chunks into pieces of
``window_bytes`` (a multiple of the checksum segment, so each piece hashes its own segments),
small chunks batched into one write (the alignment padding between them zeroed). Worker threads
copy (when needed), hash and ``pwrite``; the file is made durable before the function returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..config import Config
from ..format.dtypes import buffer_of, byte_view
from ..planning.save_plan import WriteItem
from ..storage.base import Storage, WriteHandle
from .checksum import segment_digests
from .memcpy import copy_tensor


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, start + nbytes)`` of write item ``item``."""

    item: int
    start: int
    nbytes: int


@dataclass(frozen=True)
class WriteTask:
    """One positional write of ``nbytes`` at ``file_offset``, made of consecutive spans."""

    file_offset: int
    nbytes: int
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class WriteResult:
    """The checksums of every item this rank wrote, in item order."""

    checksums: tuple[tuple[str, ...], ...]
    nbytes: int


def build_tasks(
    items: Sequence[WriteItem], window_bytes: int, small_bytes: int, splittable: Sequence[bool]
) -> list[WriteTask]:
    """Cut items (in file order) into tasks: big ones split, small ones batched."""
    tasks: list[WriteTask] = []
    batch: list[Span] = []

    def flush() -> None:
        if batch:
            start = items[batch[0].item].byte_offset
            last = items[batch[-1].item]
            tasks.append(WriteTask(start, last.byte_offset + last.nbytes - start, tuple(batch)))
            batch.clear()

    for i, item in enumerate(items):
        if item.nbytes >= small_bytes:
            flush()
            step = window_bytes if splittable[i] else max(item.nbytes, 1)
            for start in range(0, item.nbytes, step):
                n = min(step, item.nbytes - start)
                tasks.append(WriteTask(item.byte_offset + start, n, (Span(i, start, n),)))
        else:
            batch.append(Span(i, 0, item.nbytes))
            if sum(s.nbytes for s in batch) >= window_bytes:
                flush()
    flush()
    return tasks


class ItemSource:
    """The bytes of one write item: a contiguous CPU tensor, or a view to copy from."""

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view
        self.direct = view.device.type == "cpu" and view.is_contiguous()

    def contiguous_bytes(self) -> torch.Tensor:
        t = self.view if self.direct else self.view.to("cpu").contiguous()
        return byte_view(t)

    def copy_into(self, out: torch.Tensor) -> None:
        """Copy the item's elements into ``out`` (a uint8 tensor of the item's size)."""
        copy_tensor(out, self.contiguous_bytes())


def write_file(
    storage: Storage,
    name: str,
    items: Sequence[WriteItem],
    sources: Sequence[ItemSource],
    config: Config,
    progress: Callable[[int, int], None] | None = None,
) -> WriteResult:
    """Write ``items`` from ``sources`` into ``name``; durable on return.

    ``progress(bytes_written, bytes_total)`` is called as each piece lands.
    """
    total = items[-1].byte_offset + items[-1].nbytes if items else 0
    splittable = [s.direct for s in sources]
    tasks = build_tasks(items, config.window_bytes, config.small_chunk_bytes, splittable)
    offsets = [i.byte_offset for i in items]
    handle = storage.create(name, total)
    digests: dict[tuple[int, int], list[str]] = {}
    try:
        with ThreadPoolExecutor(config.io_threads, thread_name_prefix="unickpt-write") as pool:
            futures = [
                pool.submit(_run_task, handle, task, sources, offsets, config.segment_bytes)
                for task in tasks
            ]
            done = 0
            for task, fut in zip(tasks, futures):
                for key, value in fut.result().items():
                    digests[key] = value
                done += task.nbytes
                if progress is not None:
                    progress(done, total)
    except BaseException:
        handle.close(durable=False)
        storage.remove(name)
        raise
    handle.close(durable=True)
    return WriteResult(_ordered(digests, items, config.segment_bytes), total)


def _run_task(
    handle: WriteHandle,
    task: WriteTask,
    sources: Sequence[ItemSource],
    offsets: Sequence[int],
    segment: int,
) -> dict[tuple[int, int], list[str]]:
    out: dict[tuple[int, int], list[str]] = {}
    if len(task.spans) == 1:
        span = task.spans[0]
        data = sources[span.item].contiguous_bytes()[span.start : span.start + span.nbytes]
        mv = buffer_of(data)
        out[(span.item, span.start)] = segment_digests(mv, segment)
        handle.write_at(task.file_offset, mv)
        return out
    buf = torch.zeros(task.nbytes, dtype=torch.uint8)
    for span in task.spans:
        pos = offsets[span.item] - task.file_offset
        part = buf[pos : pos + span.nbytes]
        if span.nbytes:
            sources[span.item].copy_into(part)
        out[(span.item, 0)] = segment_digests(buffer_of(part), segment)
    handle.write_at(task.file_offset, buffer_of(buf))
    return out


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
