"""Files fetched from a peer straight into the training state: only the chunks a rank loads.

When every read a restoring rank makes of a file it fetches is a whole chunk into contiguous CPU
memory (a load into the layout that saved it: the usual restart), the rank names those chunks'
byte ranges and the peer sends exactly those, in file order, in messages both sides cut alike
(:func:`messages`). A large chunk goes in pieces, each received straight into its part of the
destination tensor; a run of small chunks goes as one message into a scratch buffer and is
copied to its tensors. The loader then verifies every chunk's checksums where it lies, as after
a read (:meth:`Targets.serve` answers its reads), so damage still fails the load loudly.

Nothing is written to the node's memory folder: the peer's copy keeps serving the file, and the
node's next memory save writes a fresh local copy of its own. Peak extra memory: one scratch
buffer of at most a piece, and gloo's own buffers.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SMALL_BYTES = 1 << 20  # chunks below this travel together with their neighbours


@dataclass(frozen=True)
class Message:
    """File bytes ``[start, end)``, carrying ``ranges`` (indices): the pieces of one large range
    that lie there, or several small ranges whole (with the gaps between them)."""

    start: int
    end: int
    ranges: tuple[int, ...]


def messages(ranges: Sequence[tuple[int, int]], piece: int) -> list[Message]:
    """How the ranges ``(offset, nbytes)`` of a file, sorted and disjoint, travel: the same
    answer on both sides. Empty ranges carry no message."""
    out: list[Message] = []
    group: list[int] = []

    def flush() -> None:
        if group:
            first, last = ranges[group[0]], ranges[group[-1]]
            out.append(Message(first[0], last[0] + last[1], tuple(group)))
            group.clear()

    for i, (offset, nbytes) in enumerate(ranges):
        if nbytes == 0:
            continue
        if nbytes >= min(SMALL_BYTES, piece):
            flush()
            for a in range(offset, offset + nbytes, piece):
                out.append(Message(a, min(a + piece, offset + nbytes), (i,)))
            continue
        if group and offset + nbytes - ranges[group[0]][0] > piece:
            flush()
        group.append(i)
    flush()
    return out


class Targets:
    """Where the ranges of each directly fetched file land: the destination bytes (contiguous
    uint8 views of the state's tensors) of the loader's reads, sorted by file offset."""

    def __init__(self, files: dict[Path, list[tuple[int, torch.Tensor]]]) -> None:
        self._files = {p: sorted(v, key=lambda r: r[0]) for p, v in files.items()}
        self._starts = {p: [o for o, _ in v] for p, v in self._files.items()}

    def __contains__(self, path: Path) -> bool:
        return path in self._files

    def ranges(self, path: Path) -> list[tuple[int, int]]:
        return [(o, t.numel()) for o, t in self._files[path]]

    def receive(
        self,
        path: Path,
        message: Message,
        recv: Callable[[torch.Tensor], object],
        scratch: Callable[[int], torch.Tensor],
    ) -> None:
        """Receive one message with ``recv``: into its range's tensor, or through ``scratch``."""
        where = self._files[path]
        if len(message.ranges) == 1:
            offset, dest = where[message.ranges[0]]
            if offset <= message.start and message.end <= offset + dest.numel():
                recv(dest[message.start - offset : message.end - offset])
                return
        buf = scratch(message.end - message.start)
        recv(buf)
        for i in message.ranges:
            offset, dest = where[i]
            a = offset - message.start
            np.copyto(dest.numpy(), buf[a : a + dest.numel()].numpy())

    def serve(self, path: Path, offset: int, out: memoryview) -> None:
        """Fill ``out`` with file bytes from ``offset`` (received already): nothing to do where
        ``out`` is where they were received, as for the load's own reads. A read may span
        several chunks (the loader reads small neighbours together): the padding between
        them, never received, is left as it is; a read that starts or ends outside the chunks
        received is a bug."""
        n = len(out)
        if not n:
            return
        where, end = self._files[path], offset + n
        i = max(0, bisect.bisect_right(self._starts[path], offset) - 1)
        into = np.frombuffer(out, dtype=np.uint8)
        covered = []
        for start, dest in where[i:]:
            if start >= end:
                break
            lo, hi = max(offset, start), min(end, start + dest.numel())
            if lo >= hi:
                continue
            covered.append((lo, hi))
            src, dst = dest[lo - start : hi - start].numpy(), into[lo - offset : hi - offset]
            if dst.ctypes.data != src.ctypes.data:
                np.copyto(dst, src)
        if not covered or covered[0][0] != offset or covered[-1][1] != end:
            raise RuntimeError(
                f"a load read bytes [{offset}, {end}) of {path}, which was fetched "
                "for the chunks it was planned to read only; this is a bug in unickpt."
            )
