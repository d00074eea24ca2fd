"""Copying a rank's parts out of the bytes of a shared unit (see :mod:`unickpt.engine.exchange`).

A part is a box of a saved chunk that one rank needs; in a load into another layout it is
typically half of every row. Parts are copied by NumPy in their own layouts
(:func:`unickpt.engine.memcpy.copy_elements`): a ``Tensor.copy_`` per part would open an OpenMP
region from every I/O thread of every rank of the host at once.

The owner of a unit verifies it and copies its own parts in one pass (:func:`verify_and_copy`):
each checksum segment is hashed, then the rows of its parts that end in the bytes verified so
far are copied while those bytes are still in the CPU's cache, so the owner reads its unit from
memory once instead of twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..layouts.boxes import row_major_strides
from ..planning.exchange_plan import Unit, flat_span
from ..planning.load_plan import ReadItem
from .memcpy import copy_elements, elements
from .read_chunks import ChunkRef, check_segments


@dataclass(frozen=True)
class PartCopy:
    """One part of a unit: ``src`` (a view of the unit's bytes) goes to ``dst``. Both have the
    part's leading dimensions of length 1 dropped; slice ``k`` of ``src`` along its first
    dimension lies in unit bytes ``[first + k * step, first + k * step + span)`` (``step`` 0:
    the part is one slice)."""

    src: torch.Tensor
    dst: torch.Tensor
    first: int
    step: int
    span: int
    nbytes: int

    @property
    def slices(self) -> int:
        return int(self.src.shape[0]) if self.step else 1

    def end(self, stop: int) -> int:
        """Unit bytes that slices ``[0, stop)`` reach."""
        return self.first + (stop - 1) * self.step + self.span


def part_copies(
    raw: torch.Tensor, u: Unit, needed: Sequence[ReadItem], rank: int
) -> list[PartCopy]:
    """``rank``'s parts of unit ``u``, whose bytes are the uint8 tensor ``raw``."""
    strides = row_major_strides(u.chunk.lengths)
    out = []
    for p in u.parts:
        if p.rank != rank:
            continue
        item = needed[p.need]
        typed = raw.view(item.dest.dtype)
        first, end = flat_span(u.chunk, p.box)
        base = typed.storage_offset() - u.lo // u.itemsize
        src = torch.as_strided(typed, p.box.lengths, strides, base + first)
        dst = item.dest[p.box.relative_to(item.region)]
        lengths = p.box.lengths
        lead = next((i for i, n in enumerate(lengths) if n > 1), None)
        span, step = end - first, 0
        if lead is not None:
            src, dst = src[(0,) * lead], dst[(0,) * lead]
            step = strides[lead]
            span -= (lengths[lead] - 1) * step
        size = u.itemsize
        out.append(
            PartCopy(src, dst, first * size - u.lo, step * size, span * size, p.box.numel * size)
        )
    return out


def copy_parts(raw: torch.Tensor, u: Unit, needed: Sequence[ReadItem], rank: int) -> int:
    """Copy ``rank``'s parts of unit ``u`` out of ``raw`` (the unit's bytes); bytes placed."""
    placed = 0
    for c in part_copies(raw, u, needed, rank):
        copy_elements(c.dst, c.src)
        placed += c.nbytes
    return placed


def verify_and_copy(
    raw: torch.Tensor, u: Unit, needed: Sequence[ReadItem], rank: int, segment: int
) -> int:
    """Verify every checksum segment of unit ``u`` (its bytes: ``raw``) and copy ``rank``'s
    parts, each block of rows right after the segment it ends in; bytes placed. Raises
    CheckpointCorruptError on damage (rows of earlier segments may have been copied)."""
    ref = ChunkRef(u.key, u.file, u.chunk)
    blocks: list[tuple[int, int, int, int]] = []  # (end, copy, first slice, stop)
    copies = part_copies(raw, u, needed, rank)
    for i, c in enumerate(copies):
        per = max(1, segment // c.step) if c.step else 1
        for k in range(0, c.slices, per):
            stop = min(c.slices, k + per)
            blocks.append((c.end(stop), i, k, stop))
    blocks.sort()
    views = [_views(c) for c in copies]
    done, size = 0, raw.numel()
    for end, i, k, stop in blocks:
        while done < end:
            check_segments(ref, u.lo + done, raw[done : done + segment], segment)
            done += segment
        c, pair = copies[i], views[i]
        if pair is not None:  # NumPy views made once per part, not once per block
            np.copyto(pair[0][k:stop], pair[1][k:stop])
        else:
            copy_elements(c.dst[k:stop] if c.step else c.dst, c.src[k:stop] if c.step else c.src)
    while done < size:
        check_segments(ref, u.lo + done, raw[done : done + segment], segment)
        done += segment
    return sum(c.nbytes for c in copies)


def _views(c: PartCopy) -> tuple[np.ndarray, np.ndarray] | None:
    """NumPy views of a part sliced along its first dimension (None: torch copies it)."""
    if not c.step or c.src.dtype != c.dst.dtype:
        return None
    d, s = elements(c.dst), elements(c.src)
    return None if d is None or s is None else (d, s)
