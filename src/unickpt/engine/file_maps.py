"""Memory maps of the files a load reads, one per file, shared by the load's threads.

A file is mapped once, over the span of the byte ranges the load will take from it, by the
first thread that needs it, and stays mapped until :meth:`FileMaps.close`: one ``mmap`` and one
``munmap`` per file instead of one per range (each unmapping interrupts every processor running
a thread of the process to flush its address translations). The span is large enough for the
kernel to map the page cache's huge pages whole where it holds them. The maps are dropped in
the background once the load is done with them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from ..storage.base import Storage


class FileMaps:
    """Views of ``spans[file] = (lo, hi)`` (file offsets) of each file, through one map each."""

    def __init__(self, storage: Storage, ranges: Iterable[tuple[str, int, int]]) -> None:
        """``ranges``: ``(file, offset, nbytes)`` that :meth:`view` will be asked for."""
        self.storage = storage
        self.spans: dict[str, tuple[int, int]] = {}
        for file, offset, nbytes in ranges:
            lo, hi = offset, offset + nbytes
            a, b = self.spans.get(file, (lo, hi))
            self.spans[file] = (min(a, lo), max(b, hi))
        self._lock = threading.Lock()
        self._maps: dict[str, torch.Tensor | None] = {}

    def view(self, file: str, offset: int, nbytes: int) -> torch.Tensor | None:
        """File bytes ``[offset, offset + nbytes)`` (inside the span given for ``file``) as a
        uint8 tensor over the map, or None when the file cannot be mapped."""
        with self._lock:
            if file not in self._maps:
                lo, hi = self.spans[file]
                mapped = self.storage.map_range(file, lo, hi - lo)
                self._maps[file] = None if mapped is None else _tensor(mapped)
            whole = self._maps[file]
        if whole is None:
            return None
        start = offset - self.spans[file][0]
        return whole[start : start + nbytes]

    def close(self) -> None:
        """Drop the maps, each unmapped once the last view of it is freed. Unmapping undoes the
        mapping of every page (about 5 ms for 256 MiB of 4 KiB pages), so a thread of its own
        drops them: the load returns as soon as its values are in place. Not a daemon: an
        interpreter that exits waits the few milliseconds for it rather than stopping it inside
        torch's deleter of a map's tensor (which aborts the process)."""
        with self._lock:
            maps, self._maps = self._maps, {}
        if not any(m is not None for m in maps.values()):
            return
        try:
            threading.Thread(target=maps.clear, name="unickpt-unmap").start()
        except RuntimeError:  # no thread to be had (a limit, or the interpreter is ending)
            maps.clear()


def _tensor(view: memoryview) -> torch.Tensor:
    return (
        torch.frombuffer(view, dtype=torch.uint8)
        if len(view)
        else torch.empty(0, dtype=torch.uint8)
    )
