"""The read plan: which saved chunks overlap which destination boxes.

Matching uses an index per tensor (chunks sorted along their most-split dimension), so a
destination box looks at the chunks that can overlap it, never at all of them. The chunks of a
tensor that is read must tile it exactly (:func:`check_chunks_tile`), so every wanted element
comes from exactly one chunk.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..errors import CheckpointCorruptError
from ..format.metadata import ChunkMeta, TensorMeta
from ..layouts.boxes import Box
from ..layouts.coverage import cached_tiling_fault


@dataclass(frozen=True)
class ReadItem:
    """Copy ``region`` (global coordinates) of a saved chunk into ``dest`` (region-shaped)."""

    key: str
    file: str
    chunk: ChunkMeta
    region: Box
    dest: torch.Tensor


class ChunkIndex:
    """Saved chunks of one tensor, sorted along the dimension that splits them most."""

    def __init__(self, chunks: tuple[ChunkMeta, ...]) -> None:
        ndim = len(chunks[0].offsets) if chunks else 0
        self.dim = 0
        if ndim:
            spread = [len({c.offsets[d] for c in chunks}) for d in range(ndim)]
            self.dim = max(range(ndim), key=lambda d: spread[d])
        self.chunks = sorted(chunks, key=lambda c: c.offsets[self.dim] if ndim else 0)
        self.starts = [c.offsets[self.dim] if ndim else 0 for c in self.chunks]
        self.max_len = max((c.lengths[self.dim] if ndim else 1 for c in chunks), default=0)
        self.ndim = ndim

    def overlapping(self, box: Box) -> list[tuple[ChunkMeta, Box]]:
        """Chunks overlapping ``box``, each with the overlap."""
        if self.ndim == 0:
            return [(c, box) for c in self.chunks]
        lo = box.offsets[self.dim] - self.max_len + 1
        hi = box.offsets[self.dim] + box.lengths[self.dim]
        first = bisect.bisect_left(self.starts, lo)
        last = bisect.bisect_left(self.starts, hi)
        found = []
        for chunk in self.chunks[first:last]:
            overlap = chunk.box.intersect(box)
            if overlap is not None:
                found.append((chunk, overlap))
        return found


def plan_reads(
    key: str,
    meta: TensorMeta,
    files: tuple[str, ...],
    pieces: list[tuple[Box, torch.Tensor]],
    index: ChunkIndex | None = None,
) -> list[ReadItem]:
    """Read items that fill every destination piece of one tensor."""
    index = index or ChunkIndex(meta.chunks)
    items = []
    for box, view in pieces:
        for chunk, overlap in index.overlapping(box):
            dest = view[overlap.relative_to(box)] if box.ndim else view
            items.append(ReadItem(key, files[chunk.file], chunk, overlap, dest))
    return items


def check_chunks_tile(key: str, meta: TensorMeta) -> None:
    """Raise :class:`CheckpointCorruptError` unless the saved chunks of ``key`` hold every
    element of the tensor exactly once (a damaged or forged index could overlap them)."""
    fault = cached_tiling_fault(meta.shape, [c.box for c in meta.chunks])
    if fault is not None:
        raise CheckpointCorruptError(
            f"the saved chunks of '{key}' (global shape {list(meta.shape)}) do not tile it: "
            f"{fault.describe()}; the metadata is damaged. Load an earlier checkpoint."
        )
