"""Cut a rank's data file into parts a backend can take: local files, object-store uploads.

The parts tile the file exactly (alignment padding between chunks included). A part is closed
once it holds ``target_bytes``, and at the boundaries of large chunks (so a large chunk starts
and ends its own parts, as one positional write each) whenever the part already holds the
backend's minimum: every part but the last has at least ``min_bytes``, raised when needed so
that a file has at most ``max_parts`` parts. Inside a part a chunk appears whole, or as a
piece that starts at a multiple of the checksum segment (counted from the chunk's start) and
ends at one or at the chunk's end, so each part hashes whole segments. Chunks smaller than
``small_bytes`` are never cut (many share a part), nor are chunks whose source is not
contiguous CPU memory (they are copied whole once), unless the backend caps a part's size
(S3: 5 GiB) and such a chunk exceeds a quarter of the cap: then it is cut too, and each piece
is copied on its own. Under a cap, parts close early enough that no part exceeds it; a file
that cannot fit in ``max_parts`` parts of at most ``max_bytes`` is refused before any upload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import CheckpointError

_PADDING = 64
"""The most alignment padding between two items of a data file."""


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
    """Parts of about ``target_bytes``; at least ``min_bytes`` (but the last), at most
    ``max_bytes`` and at most ``max_parts`` of them."""

    target_bytes: int
    segment_bytes: int
    small_bytes: int
    min_bytes: int = 0
    max_parts: int | None = None
    max_bytes: int | None = None

    def must_cut(self, nbytes: int) -> bool:
        """Whether a chunk is cut even where its source is not contiguous CPU memory."""
        return self.max_bytes is not None and nbytes > self.max_bytes // 4

    def cap_bytes(self) -> int | None:
        """The most a part may be closed at so that, with an uncut chunk (at most a quarter
        of ``max_bytes``, or below ``small_bytes``), a segment and padding, it stays within
        ``max_bytes``."""
        if self.max_bytes is None:
            return None
        uncut = max(self.max_bytes // 4, self.small_bytes, self.segment_bytes)
        room = self.max_bytes - uncut - _PADDING
        return room // self.segment_bytes * self.segment_bytes

    def least_bytes(self, file_bytes: int) -> int:
        """The smallest a part but the last may be, for a file of ``file_bytes``."""
        if self.max_parts is None:
            return self.min_bytes
        if self.max_parts < 2:
            return file_bytes + 1
        return max(self.min_bytes, -(-file_bytes // (self.max_parts - 1)))

    def close_bytes(self, file_bytes: int) -> int:
        """The size a part is closed at: the target, raised to the least, in whole segments,
        lowered to the cap. Raises :class:`CheckpointError` when the least exceeds the cap."""
        least = self.least_bytes(file_bytes)
        want = -(-max(self.target_bytes, least, 1) // self.segment_bytes) * self.segment_bytes
        cap = self.cap_bytes()
        if cap is None or want <= cap:
            return want
        if least > cap:
            count = f"{self.max_parts:,}" if self.max_parts is not None else "its"
            raise CheckpointError(
                f"a data file of {file_bytes:,} bytes does not fit in {count} parts of at most "
                f"{self.max_bytes:,} bytes (the storage backend's limits); this rank holds too "
                "much state for one file: save with more ranks."
            )
        return cap


class _Builder:
    """Collects spans into the open part; closes it when told."""

    def __init__(self, close_at: int, least: int) -> None:
        self.close_at = close_at
        self.least = max(least, 1)
        self.parts: list[Part] = []
        self.spans: list[Span] = []
        self.offset = 0
        self.size = 0

    def add(self, span: Span) -> None:
        self.spans.append(span)
        self.size += span.nbytes

    def close_if(self, at_least: int) -> None:
        if self.size >= at_least:
            self.close()

    def close(self) -> None:
        self.parts.append(Part(len(self.parts), self.offset, self.size, tuple(self.spans)))
        self.offset += self.size
        self.spans, self.size = [], 0


def plan_parts(
    extents: Sequence[tuple[int, int]], splittable: Sequence[bool], rules: PartRules
) -> list[Part]:
    """Parts for items at ``extents`` (``(byte_offset, nbytes)``, in file order).

    ``splittable[i]`` says item ``i`` may be cut (its source is contiguous CPU memory); items
    for which ``rules.must_cut`` holds are cut regardless. A file without bytes is one empty
    part.

    >>> rules = PartRules(target_bytes=64, segment_bytes=64, small_bytes=32)
    >>> [p.nbytes for p in plan_parts([(0, 10), (64, 100), (192, 20)], [True] * 3, rules)]
    [64, 64, 64, 20]
    """
    file_bytes = extents[-1][0] + extents[-1][1] if extents else 0
    close_at, segment = rules.close_bytes(file_bytes), rules.segment_bytes
    b = _Builder(close_at, rules.least_bytes(file_bytes))
    end = 0
    for i, (offset, nbytes) in enumerate(extents):
        if offset < end:
            raise AssertionError(f"item {i} at {offset} overlaps the one before (ends at {end})")
        if offset > end:
            b.add(Span(None, 0, offset - end))
        large = nbytes > 0 and nbytes >= rules.small_bytes
        if large:
            b.close_if(b.least)  # a large chunk starts a part when the open one may end
        start = 0
        cut = large and (splittable[i] or rules.must_cut(nbytes))
        step = 0 if cut else nbytes
        while True:
            room = close_at - b.size
            n = step or min(nbytes - start, max(segment, -(-room // segment) * segment))
            b.add(Span(i, start, n))
            start += n
            if start >= nbytes:
                break
            b.close()  # a piece of a cut chunk fills its part
        end = offset + nbytes
        following = extents[i + 1][0] if i + 1 < len(extents) else end
        if following > end:  # the padding after a chunk goes with it
            b.add(Span(None, 0, following - end))
            end = following
        b.close_if(b.least if large else close_at)
    if b.spans or not b.parts:
        b.close()
    return b.parts
