"""Stored elements as numbers, from their raw bytes and dtype name, without torch.

``unickpt diff`` compares tensors as raw bytes (bitwise) and, where bits differ, as float64
(complex128 for complex dtypes). NumPy reads its own dtypes; bfloat16, complex32 and the float8
formats are decoded here (bfloat16 by a shift, float8 through a table of the 256 codes), giving
exactly the values torch's ``Tensor.to(torch.float64)`` gives (tested against it).
"""

from __future__ import annotations

import functools
import math

import numpy as np

# dtypes NumPy has under the same name
_NUMPY = {
    "bool": np.bool_,
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
    "uint16": np.uint16,
    "int32": np.int32,
    "uint32": np.uint32,
    "int64": np.int64,
    "uint64": np.uint64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "complex64": np.complex64,
    "complex128": np.complex128,
}

# float8 formats: exponent bits, mantissa bits, exponent bias, and how the top codes read:
# "ieee" (all-ones exponent: inf or NaN), "fn" (only S.1111.111 is NaN), "fnuz" (no -0: 0x80
# is NaN, no inf)
_FLOAT8 = {
    "float8_e4m3fn": (4, 3, 7, "fn"),
    "float8_e5m2": (5, 2, 15, "ieee"),
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
}


def is_complex(dtype: str) -> bool:
    return dtype.startswith("complex")


def widen(raw: np.ndarray, dtype: str) -> np.ndarray | None:
    """The elements of ``raw`` (uint8, the element's bytes along the last axis) as float64
    (complex128 for complex dtypes), shaped as ``raw`` without its last axis; None for dtypes
    that hold no plain numbers (quantized, bits, sub-byte integers, packed float4)."""
    shape = raw.shape[:-1]
    flat = np.ascontiguousarray(raw).reshape(-1)
    wide = is_complex(dtype)
    target = np.complex128 if wide else np.float64
    if dtype in _NUMPY:
        return flat.view(_NUMPY[dtype]).astype(target).reshape(shape)
    if dtype == "bfloat16":
        bits = flat.view(np.uint16).astype(np.uint32) << 16
        with np.errstate(invalid="ignore"):  # NaN payloads widen to NaN
            return bits.view(np.float32).astype(np.float64).reshape(shape)
    if dtype == "complex32":
        halves = flat.view(np.float16).astype(np.float64)
        return (halves[0::2] + 1j * halves[1::2]).reshape(shape)
    table = _table(dtype)
    if table is None:
        return None
    return table[flat].reshape(shape)


@functools.cache
def _table(dtype: str) -> np.ndarray | None:
    """The float64 value of each of the 256 codes of a one-byte float format."""
    if dtype == "float8_e8m0fnu":  # a power of two: 2 ** (code - 127); 255 is NaN
        return np.array([math.nan if c == 255 else 2.0 ** (c - 127) for c in range(256)])
    spec = _FLOAT8.get(dtype)
    if spec is None:
        return None
    return np.array([_decode(c, *spec) for c in range(256)], dtype=np.float64)


def _decode(code: int, ebits: int, mbits: int, bias: int, kind: str) -> float:
    sign = -1.0 if code >> 7 else 1.0
    exponent = (code >> mbits) & ((1 << ebits) - 1)
    mantissa = code & ((1 << mbits) - 1)
    top = (1 << ebits) - 1
    if kind == "fnuz" and code == 0x80:
        return math.nan
    if kind == "fn" and exponent == top and mantissa == (1 << mbits) - 1:
        return math.nan
    if kind == "ieee" and exponent == top:
        return math.nan if mantissa else sign * math.inf
    if exponent == 0:  # subnormal
        return sign * mantissa / (1 << mbits) * 2.0 ** (1 - bias)
    return sign * (1 + mantissa / (1 << mbits)) * 2.0 ** (exponent - bias)
