"""Stored elements widened without torch: the values torch's ``to(float64)`` gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unickpt.tools.numeric import widen

ONE_BYTE = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]


@pytest.mark.parametrize("name", ONE_BYTE)
def test_every_float8_code_widens_as_torch_does(name: str) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(getattr(torch, name)).to(torch.float64).numpy()
    assert np.array_equal(widen(codes.numpy().reshape(256, 1), name), expected, equal_nan=True)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_every_two_byte_code_widens_as_torch_does(name: str) -> None:
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16)
    expected = codes.view(getattr(torch, name)).to(torch.float64).numpy()
    raw = codes.view(torch.uint8).numpy().reshape(-1, 2)
    assert np.array_equal(widen(raw, name), expected, equal_nan=True)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_other_dtypes_widen_as_torch_does() -> None:
    torch.manual_seed(0)
    values = {
        "complex32": torch.randn(12, dtype=torch.complex64).to(torch.complex32),
        "complex64": torch.randn(12, dtype=torch.complex64),
        "int64": torch.tensor([-(2**62) - 1, 2**53 + 1, 0, 7]),
        "uint64": torch.tensor([2**64 - 1, 3], dtype=torch.uint64),
        "bool": torch.tensor([True, False]),
    }
    for name, t in values.items():
        raw = t.view(torch.uint8).numpy().reshape(*t.shape, t.element_size())
        wide = torch.complex128 if t.is_complex() else torch.float64
        expected = t.to(wide).numpy() if name != "uint64" else np.array([2.0**64, 3.0])
        assert np.array_equal(widen(raw, name), expected), name
    assert widen(np.zeros((3, 1), dtype=np.uint8), "qint8") is None
