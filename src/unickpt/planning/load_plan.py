"""The read plan: which saved chunks overlap which destination boxes.

Matching uses an index per tensor (chunks sorted along their most-split dimension), so a
destination box looks at the chunks that can overlap it, never at all of them. The chunks of a
tensor that is read must tile it exactly (:func:`check_chunks_tile`, on arrays, remembered per
split pattern as at save), so every wanted element comes from exactly one chunk.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CheckpointCorruptError
from ..format.metadata import ChunkMeta, TensorMeta
from ..layouts.arrays import distinct
from ..layouts.boxes import Box
from ..layouts.coverage import TilingFault, tiling_fault
from .patterns import pattern_of

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ReadItem:
    """Copy ``region`` (global coordinates) of a saved chunk into ``dest`` (region-shaped)."""

    key: str
    file: str
    chunk: ChunkMeta
    region: Box
    dest: torch.Tensor


class ChunkIndex:
    """Saved chunks of one tensor, sorted along the dimension that splits them most.

    The chunks' offsets and lengths are read into one array (one pass, no object per chunk);
    a destination box looks only at the chunks whose start along that dimension lies within
    the longest chunk's reach of it, and builds objects only for those that overlap it. A
    tensor of a few chunks (most of them: one per rank that saved it, or one) is matched
    chunk by chunk instead, without arrays: NumPy's cost per call would be most of it.
    """

    def __init__(self, chunks: tuple[ChunkMeta, ...] | list[ChunkMeta]) -> None:
        self.all = tuple(chunks)
        ndim = len(chunks[0].offsets) if chunks else 0
        self.ndim = ndim
        self.few = len(self.all) <= _FEW
        if self.few:
            self.dim = _spread_dim([c.offsets for c in self.all], ndim)
            self._few_order = sorted(range(len(self.all)), key=self._start)
            return
        coords = self.coords
        self.dim = 0
        if ndim and len(coords):
            spread = [len(distinct(coords[:, d])) for d in range(ndim)]
            self.dim = int(np.argmax(spread))
        along = coords[:, self.dim] if ndim else np.zeros(len(coords), dtype=np.int64)
        self.order = np.argsort(along, kind="stable")
        self.starts = along[self.order]
        self.max_len = int(coords[:, ndim + self.dim].max()) if ndim and len(coords) else 0

    def _start(self, i: int) -> int:
        return self.all[i].offsets[self.dim] if self.ndim else 0

    @functools.cached_property
    def coords(self) -> np.ndarray:
        """One row per chunk: its offsets, then its lengths."""
        ndim = self.ndim
        return np.fromiter(
            itertools.chain.from_iterable(c.offsets + c.lengths for c in self.all),
            dtype=np.int64,
            count=len(self.all) * 2 * ndim,
        ).reshape(len(self.all), 2 * ndim)

    @property
    def chunks(self) -> list[ChunkMeta]:
        """The chunks in the index's order."""
        order = self._few_order if self.few else self.order.tolist()
        return [self.all[i] for i in order]

    def overlapping(self, box: Box) -> list[tuple[ChunkMeta, Box]]:
        """Chunks overlapping ``box``, each with the overlap."""
        if self.ndim == 0:
            return [(c, box) for c in self.chunks]
        if self.few:
            chunks = self.chunks
        else:  # those whose rows meet the box, in the index's order
            lo = box.offsets[self.dim] - self.max_len + 1
            hi = box.offsets[self.dim] + box.lengths[self.dim]
            first, last = np.searchsorted(self.starts, [lo, hi], side="left").tolist()
            near = self.order[first:last]
            rows = self.coords[near]
            offsets, lengths = rows[:, : self.ndim], rows[:, self.ndim :]
            want_lo, want_hi = np.array(box.offsets), np.array(box.ends)
            meets = (offsets < want_hi) & (offsets + lengths > want_lo) & (lengths > 0)
            chunks = [self.all[i] for i in near[meets.all(axis=1)].tolist()]
        return [(c, o) for c in chunks if (o := c.box.intersect(box)) is not None]


_FEW = 8


def _spread_dim(offsets: list[tuple[int, ...]], ndim: int) -> int:
    """The first dimension along which the offsets take the most distinct values."""
    best, dim = 0, 0
    for d in range(ndim):
        n = len({o[d] for o in offsets})
        if n > best:
            best, dim = n, d
    return dim


def plan_reads(
    key: str,
    meta: TensorMeta,
    files: tuple[str, ...],
    pieces: list[tuple[Box, torch.Tensor]],
    index: ChunkIndex | None = None,
) -> list[ReadItem]:
    """Read items that fill every destination piece of one tensor. The chunks were checked to
    tile the tensor (disjoint, every element once), so the overlaps of a piece fill it exactly
    when their elements add up to its own; anything less is refused, never left unread."""
    index = index or ChunkIndex(meta.chunks)
    items = []
    for box, view in pieces:
        covered = 0
        for chunk, overlap in index.overlapping(box):
            dest = view[overlap.relative_to(box)] if box.ndim else view
            items.append(ReadItem(key, files[chunk.file], chunk, overlap, dest))
            covered += overlap.numel
        if covered != box.numel:
            raise CheckpointCorruptError(
                f"'{key}': the saved chunks found hold {covered} of the {box.numel} elements "
                f"of the box at {list(box.offsets)} of lengths {list(box.lengths)} this rank "
                "loads; the checkpoint's indexes or chunk map do not describe its data. Load "
                "an earlier checkpoint."
            )
    return items


def check_chunks_tile(key: str, meta: TensorMeta) -> ChunkIndex:
    """Raise :class:`CheckpointCorruptError` unless the saved chunks of ``key`` hold every
    element of the tensor exactly once (a damaged or forged index could overlap them); the
    index of the chunks, built for the check, for matching."""
    index = ChunkIndex(meta.chunks)
    shape = meta.shape
    rows = index.coords if index.ndim == len(shape) and len(meta.chunks) else None
    if rows is None:
        fault = tiling_fault(shape, [c.box for c in meta.chunks])
    else:
        fault = rows_fault(shape, rows)
    if fault is not None:
        raise not_tiled(key, shape, fault)
    return index


def rows_fault(shape: tuple[int, ...], rows: np.ndarray) -> TilingFault | None:
    """Why chunks given as coordinate rows (offsets, then lengths, as many as ``shape`` has
    dimensions; at least one row) do not tile a tensor of ``shape``, or None."""
    pattern = pattern_of(shape, rows)
    twice = pattern.first[pattern.counts > 1]  # a chunk listed twice (not an empty one)
    twice = twice[(rows[twice, len(shape) :] > 0).all(axis=1)]
    if len(twice):
        row = rows[int(twice[0])].tolist()
        return TilingFault("overlap", Box(tuple(row[: len(shape)]), tuple(row[len(shape) :])))
    return pattern.fault


def not_tiled(key: str, shape: tuple[int, ...], fault: TilingFault) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"the saved chunks of '{key}' (global shape {list(shape)}) do not tile it: "
        f"{fault.describe()}; the metadata is damaged. Load an earlier checkpoint."
    )
