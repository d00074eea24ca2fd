"""Reading quantized tables: the stored rows a destination needs, then decoding them.

A destination box of an encoded table needs its rows whole (a row's scale and minimum come
first): the read plan fills a uint8 buffer with those stored rows, from whichever saved chunks
hold them, and each :class:`DecodeItem` then decodes its buffer into the destination's columns.
Memory: the stored rows of every destination box of this rank (about a quarter (8-bit) or an
eighth (4-bit) of the float32 values they decode to) plus one block of decoded rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CheckpointCorruptError
from ..format.metadata import Encoding, TensorMeta
from ..layouts.boxes import Box
from ..planning.load_plan import ChunkIndex, ReadItem, plan_reads
from .rowwise import BITS, NAME, decode_rows_into, stored_width


@dataclass(frozen=True)
class DecodeItem:
    """Stored rows (filled by the reads) to decode into ``dest``, from ``first_column``."""

    stored: torch.Tensor
    bits: int
    columns: int
    dest: torch.Tensor
    first_column: int

    def run(self) -> None:
        decode_rows_into(self.stored, self.bits, self.columns, self.dest, self.first_column)


@dataclass(frozen=True)
class EncodedReads:
    reads: list[ReadItem]
    decodes: list[DecodeItem]
    stored_pieces: list[tuple[Box, torch.Tensor]]


def plan_encoded_reads(
    key: str,
    meta: TensorMeta,
    files: tuple[str, ...],
    pieces: list[tuple[Box, torch.Tensor]],
    index: ChunkIndex | None = None,
) -> EncodedReads:
    """Reads of the stored rows that ``pieces`` (boxes of the decoded table) need, and the
    decoding into them."""
    encoding = _checked(key, meta)
    width = meta.shape[1]
    stored_pieces, decodes = [], []
    for box, dest in pieces:
        buffer = torch.empty((box.lengths[0], width), dtype=torch.uint8)
        stored_pieces.append((stored_rows(meta, box), buffer))
        decodes.append(DecodeItem(buffer, encoding.bits, encoding.shape[1], dest, box.offsets[1]))
    reads = plan_reads(key, meta, files, stored_pieces, index or ChunkIndex(meta.chunks))
    return EncodedReads(reads, decodes, stored_pieces)


def stored_rows(meta: TensorMeta, box: Box) -> Box:
    """The stored box that a box of the decoded table needs: its rows, whole (every stored
    column: a row's scale and minimum, then its packed values)."""
    return Box((box.offsets[0], 0), (box.lengths[0], meta.shape[1]))


def _checked(key: str, meta: TensorMeta) -> Encoding:
    e = meta.encoding
    assert e is not None
    sound = (
        e.name == NAME
        and e.bits in BITS
        and len(e.shape) == 2
        and meta.shape == (e.shape[0], stored_width(e.shape[1], e.bits))
        and meta.dtype == "uint8"
    )
    if not sound:
        raise CheckpointCorruptError(
            f"'{key}' is stored as {meta.dtype} {list(meta.shape)} with encoding {e.name} "
            f"{e.bits} bits of {list(e.shape)}, which do not match; the metadata is damaged. "
            "Load an earlier checkpoint."
        )
    return e
