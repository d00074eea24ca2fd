"""Per-row 8-bit and 4-bit codes: exact decoded values, packing, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unickpt.encoding.rowwise import (
    ErrorSums,
    dequantize_rows,
    quantize_rows,
    stored_width,
)


def _expected(table: np.ndarray, bits: int) -> np.ndarray:
    """The decoded values, computed step by step in float32 with NumPy."""
    levels = np.float32((1 << bits) - 1)
    out = np.empty_like(table)
    for r, row in enumerate(table):
        low, high = row.min(), row.max()
        scale = np.float32(high - low) / levels
        codes = np.rint((row - low) / (scale if scale > 0 else np.float32(1)))
        codes = np.clip(codes, 0, levels).astype(np.float32)
        out[r] = codes * scale + low
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_decoded_values_are_exactly_the_affine_codes(bits: int) -> None:
    rng = np.random.default_rng(3)
    table = rng.standard_normal((40, 13)).astype(np.float32)
    table[5] = 7.25  # a constant row decodes exactly
    table[6] = np.arange(13, dtype=np.float32) * 0.5  # evenly spaced
    stored = quantize_rows(torch.from_numpy(table), bits)
    assert stored.shape == (40, stored_width(13, bits)) and stored.dtype == torch.uint8
    decoded = dequantize_rows(stored, bits, 13, torch.float32)
    expected = _expected(table, bits)
    assert np.array_equal(decoded.numpy().view(np.uint32), expected.view(np.uint32))
    assert torch.equal(decoded[5], torch.full((13,), 7.25))
    header = stored[:, :8].clone().view(torch.float32)
    assert header[5].tolist() == [0.0, 7.25]  # scale 0, minimum 7.25


def test_eight_bit_rows_of_a_known_table() -> None:
    table = torch.tensor([[3.0 + 0.5 * k for k in range(256)], [-1.0] * 255 + [1.0]])
    stored = quantize_rows(table, 8)
    assert stored[0, 8:].tolist() == list(range(256))
    assert stored[1, 8:].tolist() == [0] * 255 + [255]
    assert stored[0, :8].clone().view(torch.float32).tolist() == [0.5, 3.0]
    assert torch.equal(dequantize_rows(stored, 8, 256, torch.float32), table)


def test_four_bit_codes_are_packed_low_nibble_first() -> None:
    table = torch.tensor([[float(k) for k in range(16)]])
    stored = quantize_rows(table, 4)
    assert stored.shape == (1, 8 + 8)
    assert stored[0, 8:].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    odd = quantize_rows(torch.tensor([[0.0, 15.0, 5.0]]), 4)
    assert odd.shape == (1, 8 + 2) and odd[0, 8:].tolist() == [0xF0, 0x05]
    assert dequantize_rows(odd, 4, 3, torch.float32).tolist() == [[0.0, 15.0, 5.0]]
    assert torch.equal(dequantize_rows(stored, 4, 16, torch.float32), table)


def test_error_sums_and_other_dtypes() -> None:
    torch.manual_seed(0)
    table = torch.randn(300, 32, dtype=torch.bfloat16)
    sums = ErrorSums()
    stored = quantize_rows(table, 4, sums)
    decoded = dequantize_rows(stored, 4, 32, torch.bfloat16)
    diff = (decoded.double() - table.double()).abs()
    error = sums.result()
    assert error.max_abs == float(diff.max()) and sums.count == 300 * 32
    assert error.rms == pytest.approx(float(diff.square().mean().sqrt()))
    assert error.rms_relative == pytest.approx(
        float(diff.square().sum().sqrt() / table.double().square().sum().sqrt())
    )
    assert 0.0 < error.rms_relative < 0.2  # 16 levels per row
    eight = ErrorSums()
    quantize_rows(table.float(), 8, eight)
    assert eight.result().rms_relative < error.rms_relative / 8
