"""Changed rows only: an embedding table's save writes the rows that changed since the last.

For a 2-D chunk whose key matches one of a Checkpointer's ``row_deltas`` patterns, each save
computes a 64-bit digest of every row (every byte of it, mixed nonlinearly; computed with torch
over blocks of rows) and compares it with the row digests of the previous save. Runs of changed
rows are written as chunks of their own; runs of unchanged rows refer to the bytes where the
previous saves left them (the rows of a base chunk, or of an earlier run), one hop away, as
boxes of whole rows: the format needs nothing beyond references (docs/format.md), and loading,
resharding, ``verify`` and ``convert`` see an ordinary tiling of the table into row boxes.

A table is written whole (a new base) when it has no previous digests, when more than
``MAX_CHANGED_FRACTION`` of its rows changed, or when its changed rows plus the index entries
of its pieces (``PIECE_INDEX_BYTES`` each) would cost more than ``MAX_CHANGED_FRACTION`` of the
whole table; the Checkpointer's ``full_every`` compacts every table as well.

Memory: 8 bytes per row of each tracked chunk are kept between saves (the row digests), plus
one small record per piece; while digesting, about three blocks of ``BLOCK_ROWS`` rows as int64
words. The pieces of one table are one entry of the rank's index (``runs`` in
docs/format.md): per piece its row count, file, byte offset and checksum, about 35 bytes of
JSON, so scattered changes to narrow (quantized) rows still cost index bytes comparable to the
rows themselves.
"""

from __future__ import annotations

import torch

from ..format.dtypes import buffer_of
from ..layouts.boxes import Box
from .checksum import segment_digests

BLOCK_ROWS = 1 << 14
MAX_CHANGED_FRACTION = 0.5
PIECE_INDEX_BYTES = 40

_K1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_K2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_K3 = -7723592293110705685  # 0x94D049BB133111EB


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shift(x, 30)
    x = x * _K2
    x = x ^ _shift(x, 27)
    x = x * _K3
    return x ^ _shift(x, 31)


def row_digests(data: torch.Tensor, rows: int) -> torch.Tensor:
    """A 64-bit digest of each of the ``rows`` equal rows of the bytes ``data`` (int64)."""
    if rows == 0:
        return torch.empty(0, dtype=torch.int64)
    table = data.reshape(rows, -1)
    width = table.shape[1]
    words = -(-width // 8)
    salt = torch.arange(1, words + 1, dtype=torch.int64) * _K1
    out = torch.empty(rows, dtype=torch.int64)
    for lo in range(0, rows, BLOCK_ROWS):
        block = table[lo : lo + BLOCK_ROWS]
        if width % 8:
            padded = torch.zeros(block.shape[0], words * 8, dtype=torch.uint8)
            padded[:, :width] = block
            block = padded
        x = block.contiguous().view(torch.int64) + salt
        out[lo : lo + block.shape[0]] = _mix(_mix(x).sum(dim=1))
    return out


def changed_runs(changed: torch.Tensor) -> list[tuple[int, int, bool]]:
    """Maximal runs ``(start, stop, changed)`` of a boolean row mask."""
    n = changed.numel()
    if n == 0:
        return []
    cuts = (torch.nonzero(changed[1:] != changed[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, n]
    flags = changed[torch.tensor(bounds[:-1])].tolist()
    return [(a, b, bool(f)) for a, b, f in zip(bounds[:-1], bounds[1:], flags)]


def sub_box(box: Box, start: int, stop: int) -> Box:
    """Rows ``[start, stop)`` of a 2-D box (counted from the box's first row)."""
    return Box((box.offsets[0] + start, *box.offsets[1:]), (stop - start, *box.lengths[1:]))


def row_checksums(
    data: torch.Tensor, row_bytes: int, start: int, stop: int, segment: int
) -> tuple[str, ...]:
    """The checksums of rows ``[start, stop)`` of the chunk bytes ``data``."""
    return tuple(segment_digests(buffer_of(data[start * row_bytes : stop * row_bytes]), segment))


def pieces_pay(written_bytes: int, pieces: int, table_bytes: int) -> bool:
    """Whether writing ``written_bytes`` as ``pieces`` pieces beats writing the table whole."""
    return written_bytes + pieces * PIECE_INDEX_BYTES <= MAX_CHANGED_FRACTION * table_bytes
