"""Per-row asymmetric uniform quantization of 2-D tables (8 or 4 bits), as in Check-N-Run.

A stored row is its scale and minimum (float32, little-endian), then one code per column: a
byte each at 8 bits; at 4 bits two per byte, column ``2j`` in the low nibble and ``2j + 1`` in
the high one. With ``levels = 2**bits - 1``, ``scale = (max - min) / levels`` and
``code = round((x - min) / scale)``; a reader gets ``min + code * scale`` (computed in float32,
then cast to the table's dtype). Rows are independent, so any split of the rows between ranks,
at save or at load, reads and decodes the same values.

Memory: the stored rows (about a quarter (8-bit) or an eighth (4-bit) of a float32 table) plus
float32 temporaries for one block of ``BLOCK_ROWS`` rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..format.metadata import (
    ENCODING_BITS,
    ROWWISE_AFFINE,
    ROWWISE_HEADER_BYTES,
    EncodingError,
    rowwise_stored_width,
)

NAME = ROWWISE_AFFINE
BITS = ENCODING_BITS
HEADER_BYTES = ROWWISE_HEADER_BYTES
BLOCK_ROWS = 16384


def stored_width(columns: int, bits: int) -> int:
    """Bytes of one stored row: the header, then the codes."""
    return rowwise_stored_width(columns, bits)


@dataclass
class ErrorSums:
    """Running sums of the differences between values and their decoded codes."""

    max_abs: float = 0.0
    squared_error: float = 0.0
    squared_value: float = 0.0
    count: int = 0

    def add(self, other: ErrorSums) -> None:
        self.max_abs = max(self.max_abs, other.max_abs)
        self.squared_error += other.squared_error
        self.squared_value += other.squared_value
        self.count += other.count

    def result(self) -> EncodingError:
        rms = math.sqrt(self.squared_error / self.count) if self.count else 0.0
        relative = (
            math.sqrt(self.squared_error / self.squared_value) if self.squared_value > 0 else 0.0
        )
        return EncodingError(self.max_abs, rms, relative)


def quantize_rows(table: torch.Tensor, bits: int, sums: ErrorSums | None = None) -> torch.Tensor:
    """The stored rows (uint8, ``[rows, stored_width]``) of a 2-D floating tensor; the
    differences its decoding makes are added to ``sums``. Values must be finite."""
    rows, columns = table.shape
    out = torch.empty((rows, stored_width(columns, bits)), dtype=torch.uint8, device=table.device)
    for start in range(0, rows, BLOCK_ROWS):
        block = table[start : start + BLOCK_ROWS]
        _quantize_block(block, bits, out[start : start + len(block)], sums)
    return out


def _quantize_block(
    block: torch.Tensor, bits: int, out: torch.Tensor, sums: ErrorSums | None
) -> None:
    levels = (1 << bits) - 1
    x = block.to(torch.float32)
    if x.shape[1] == 0:
        low = high = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    else:
        low, high = torch.aminmax(x, dim=1)
    scale = (high - low) / levels
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.sub(x, low[:, None]).div_(divisor[:, None]).round_().clamp_(0, levels)
    codes = codes.to(torch.uint8)
    header = torch.stack((scale, low), dim=1).view(torch.uint8)
    out[:, :HEADER_BYTES] = header
    out[:, HEADER_BYTES:] = _pack(codes) if bits == 4 else codes
    if sums is not None:
        decoded = _decode(codes, scale, low, block.dtype).to(torch.float32)
        _accumulate(sums, x, decoded)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.view(codes.shape[0], -1, 2)
    return pairs[:, :, 0] | (pairs[:, :, 1] << 4)


def _unpack(packed: torch.Tensor, columns: int) -> torch.Tensor:
    both = torch.stack((packed & 0x0F, packed >> 4), dim=2)
    return both.view(packed.shape[0], -1)[:, :columns]


def _decode(
    codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return (codes.to(torch.float32) * scale[:, None] + low[:, None]).to(dtype)


def _accumulate(sums: ErrorSums, x: torch.Tensor, decoded: torch.Tensor) -> None:
    if x.numel() == 0:
        return
    diff = decoded.sub_(x)  # float32 differences, summed in float64
    sums.add(
        ErrorSums(
            float(diff.abs().max()),
            float(torch.linalg.vector_norm(diff, dtype=torch.float64) ** 2),
            float(torch.linalg.vector_norm(x, dtype=torch.float64) ** 2),
            x.numel(),
        )
    )


def dequantize_rows(
    stored: torch.Tensor, bits: int, columns: int, dtype: torch.dtype
) -> torch.Tensor:
    """The values of stored rows (uint8, ``[rows, stored_width]``) as ``[rows, columns]``."""
    header = torch.empty((stored.shape[0], HEADER_BYTES), dtype=torch.uint8, device=stored.device)
    header = header.copy_(stored[:, :HEADER_BYTES]).view(torch.float32)  # aligned for the view
    codes = stored[:, HEADER_BYTES:]
    if bits == 4:
        codes = _unpack(codes, columns)
    return _decode(codes, header[:, 0], header[:, 1], dtype)


def decode_rows_into(
    stored: torch.Tensor, bits: int, columns: int, dest: torch.Tensor, first_column: int
) -> None:
    """Decode ``stored`` rows block by block into ``dest`` (the columns ``first_column`` on of
    the decoded rows), so temporaries stay within a block."""
    width = dest.shape[1] if dest.dim() == 2 else 0
    for start in range(0, stored.shape[0], BLOCK_ROWS):
        rows = dequantize_rows(stored[start : start + BLOCK_ROWS], bits, columns, dest.dtype)
        dest[start : start + len(rows)] = rows[:, first_column : first_column + width]
