"""Cut a rank's data file into parts a backend can take: local files, object-store uploads.

The parts tile the file exactly (alignment padding between chunks included) and, except the
last, hold at least ``target_bytes`` (never less than the backend's ``min_part_bytes``). Inside
a part, a chunk appears whole or as a piece that starts at a multiple of the checksum segment
(counted from the chunk's start) and ends at one or at the chunk's end, so each part hashes
whole segments. Chunks smaller than ``small_bytes`` are never cut (many of them share a part),
nor are chunks whose source is not contiguous CPU memory (they are copied whole once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, start + nbytes)`` of item ``item``; ``item`` None is zero padding."""

    item: int | None
    start: int
    nbytes: int


@dataclass(frozen=True)
class Part:
    """Bytes ``[offset, offset + nbytes)`` of the file, made of ``spans`` in order."""

    index: int
    offset: int
    nbytes: int
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class PartRules:
    """How big parts are: about ``target_bytes``, at least ``min_bytes`` (but the last)."""

    target_bytes: int
    segment_bytes: int
    small_bytes: int
    min_bytes: int = 0

    @property
    def part_bytes(self) -> int:
        """The size a part is closed at: the target, raised to the minimum, in whole segments."""
        want = max(self.target_bytes, self.min_bytes, 1)
        return -(-want // self.segment_bytes) * self.segment_bytes


class _Builder:
    """Collects spans into the open part; closes it once it holds ``close_at`` bytes."""

    def __init__(self, close_at: int) -> None:
        self.close_at = close_at
        self.parts: list[Part] = []
        self.spans: list[Span] = []
        self.offset = 0
        self.size = 0

    def add(self, span: Span) -> None:
        self.spans.append(span)
        self.size += span.nbytes
        if self.size >= self.close_at:
            self.close()

    def close(self) -> None:
        self.parts.append(Part(len(self.parts), self.offset, self.size, tuple(self.spans)))
        self.offset += self.size
        self.spans, self.size = [], 0


def plan_parts(
    extents: Sequence[tuple[int, int]], splittable: Sequence[bool], rules: PartRules
) -> list[Part]:
    """Parts for items at ``extents`` (``(byte_offset, nbytes)``, in file order).

    ``splittable[i]`` says item ``i`` may be cut (its source is contiguous CPU memory). A file
    without bytes is one empty part.

    >>> [p.nbytes for p in plan_parts([(0, 10), (64, 100)], [True, True], PartRules(64, 64, 32))]
    [64, 64, 36]
    """
    close_at, segment = rules.part_bytes, rules.segment_bytes
    b = _Builder(close_at)
    end = 0
    for i, (offset, nbytes) in enumerate(extents):
        if offset < end:
            raise AssertionError(f"item {i} at {offset} overlaps the one before (ends at {end})")
        if offset > end:
            b.add(Span(None, 0, offset - end))
        if splittable[i] and nbytes > 0 and nbytes >= rules.small_bytes:
            start = 0
            while start < nbytes:
                room = close_at - b.size
                n = min(nbytes - start, -(-room // segment) * segment)
                b.add(Span(i, start, n))
                start += n
        else:
            b.add(Span(i, 0, nbytes))
        end = offset + nbytes
    if b.spans or not b.parts:
        b.close()
    return b.parts
