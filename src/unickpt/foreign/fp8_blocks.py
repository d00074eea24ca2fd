"""FP8 weights stored in blocks with scales (DeepSeek-V3's layout), and their dequantized values.

Such a model stores a 2-D weight ``X.weight`` as float8 codes beside ``X.weight_scale_inv``: a
float32 grid with one scale per block of ``rows x cols`` values (128 x 128 by default, the
model's ``config.json`` says so under ``quantization_config.weight_block_size``), of shape
``ceil(R / rows) x ceil(C / cols)``; the edge blocks hold what is left. A value is
``code.float() * scale`` of its block, rounded once to the dtype it loads into (what
``torch.distributed.checkpoint``'s ``QuantizedHuggingFaceStorageReader`` computes).

:func:`find_pairs` finds and checks the pairs in translated safetensors metadata;
:meth:`BlockScaled.fill` produces any byte range of a weight's dequantized row-major values
from the codes of the rows it covers and the scales of their block rows only.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from ..format.dtypes import buffer_of, dtype_from_name, itemsize
from ..format.metadata import Metadata, TensorMeta
from ..storage.base import Storage

SCALE_SUFFIX = "_scale_inv"
"""The key of a weight's scales is the weight's key with this suffix."""
DEFAULT_BLOCK = (128, 128)
CONFIG_FILE = "config.json"
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
SCALE_DTYPE = "float32"
DEQUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes a dequantized weight loads into."""

Block = tuple[int, int]


@dataclass(frozen=True)
class Stored:
    """Where a stored tensor's bytes lie: a file of the model and a byte offset in it."""

    file: str
    byte_offset: int


@dataclass(frozen=True)
class BlockScaled:
    """A block-quantized weight: codes, scales, and the dtype its values load as."""

    key: str
    shape: tuple[int, int]
    block: Block
    code_dtype: torch.dtype
    codes: Stored
    scales: Stored
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the dequantized values (row-major, ``dtype``)."""
        return self.shape[0] * self.shape[1] * itemsize(self.dtype)

    @property
    def grid(self) -> tuple[int, int]:
        """The shape of the scale grid."""
        return scale_grid(self.shape, self.block)

    def fill(self, storage: Storage, start: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[start, start + len(out))`` of the dequantized values,
        reading the codes of the rows they cover and the scales of those rows' blocks."""
        size, cols = itemsize(self.dtype), self.shape[1]
        first, end = start // size, -(-(start + out.nbytes) // size)
        r0, r1 = first // cols, -(-end // cols)
        codes = self._read_codes(storage, r0, r1)
        b0, b1 = r0 // self.block[0], -(-r1 // self.block[0])
        scales = self._read_scales(storage, b0, b1)
        dst = np.frombuffer(out, dtype=np.uint8)
        for b in range(b0, b1):
            a, z = max(r0, b * self.block[0]), min(r1, (b + 1) * self.block[0])
            values = dequantize_rows(codes[a - r0 : z - r0], scales[b - b0], self.block[1])
            raw = values.to(self.dtype).reshape(-1).view(torch.uint8).numpy()
            lo, hi = a * cols * size, z * cols * size  # the rows' bytes in the whole tensor
            lo_out, hi_out = max(lo, start), min(hi, start + out.nbytes)
            dst[lo_out - start : hi_out - start] = raw[lo_out - lo : hi_out - lo]

    def _read_codes(self, storage: Storage, r0: int, r1: int) -> torch.Tensor:
        cols = self.shape[1]
        raw = torch.empty((r1 - r0) * cols, dtype=torch.uint8)
        storage.read_into(self.codes.file, self.codes.byte_offset + r0 * cols, buffer_of(raw))
        return raw.view(self.code_dtype).view(r1 - r0, cols)

    def _read_scales(self, storage: Storage, b0: int, b1: int) -> torch.Tensor:
        width = self.grid[1]
        raw = torch.empty((b1 - b0) * width * 4, dtype=torch.uint8)
        offset = self.scales.byte_offset + b0 * width * 4
        storage.read_into(self.scales.file, offset, buffer_of(raw))
        return raw.view(torch.float32).view(b1 - b0, width)


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, block_cols: int) -> torch.Tensor:
    """float32 values of rows of one block row: each code times the scale of its column block
    (``scales``, one per block, the last one over the edge columns)."""
    values = torch.from_numpy(np.take(_code_values(codes.dtype), codes.view(torch.uint8).numpy()))
    rows, cols = values.shape
    whole = cols // block_cols
    if whole:
        inner = values[:, : whole * block_cols].view(rows, whole, block_cols)
        inner.mul_(scales[:whole].view(1, whole, 1))
    if whole * block_cols < cols:
        values[:, whole * block_cols :].mul_(scales[whole])
    return values


@functools.cache
def _code_values(dtype: torch.dtype) -> np.ndarray:
    """The float32 value of each of the 256 codes of a float8 dtype: looking codes up in it
    converts them faster than ``Tensor.float()`` does on CPUs, to the same bits."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy()


def scale_grid(shape: tuple[int, int], block: Block) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def find_pairs(meta: Metadata) -> list[str]:
    """The keys of float8 tensors stored with scales (``key + SCALE_SUFFIX``), sorted."""
    return sorted(
        key
        for key, t in meta.tensors.items()
        if t.dtype in FP8_DTYPES and key + SCALE_SUFFIX in meta.tensors
    )


def check_pair(meta: Metadata, key: str, block: Block) -> None:
    """Refuse a pair that is not a 2-D weight with a float32 scale per block."""
    weight, scales = meta.tensors[key], meta.tensors[key + SCALE_SUFFIX]
    if len(weight.shape) != 2:
        raise CheckpointMismatchError(
            f"'{key}' is {_described(weight)} with scales '{key}{SCALE_SUFFIX}'; "
            "dequantize=True reads 2-D weights with one scale per block. Load without "
            "dequantize to get the stored codes and scales."
        )
    grid = scale_grid((weight.shape[0], weight.shape[1]), block)
    if scales.dtype != SCALE_DTYPE or tuple(scales.shape) != grid:
        raise CheckpointMismatchError(
            f"'{key}{SCALE_SUFFIX}' is {_described(scales)}; with blocks of "
            f"{block[0]}x{block[1]}, '{key}' ({_described(weight)}) needs {SCALE_DTYPE} "
            f"scales {list(grid)}. Pass the model's block size as dequantize=(rows, cols), or "
            "load without dequantize."
        )


def block_scaled(meta: Metadata, key: str, block: Block, dtype: torch.dtype) -> BlockScaled:
    """The checked pair at ``key``, its values loading as ``dtype``."""
    check_pair(meta, key, block)
    weight, scales = meta.tensors[key], meta.tensors[key + SCALE_SUFFIX]
    return BlockScaled(
        key,
        (weight.shape[0], weight.shape[1]),
        block,
        dtype_from_name(weight.dtype),
        _stored(meta, weight),
        _stored(meta, scales),
        dtype,
    )


def _stored(meta: Metadata, tensor: TensorMeta) -> Stored:
    (chunk,) = tensor.chunks  # a safetensors tensor is one chunk
    return Stored(meta.files[chunk.file], chunk.byte_offset)


def _described(t: TensorMeta) -> str:
    return f"{t.dtype} {list(t.shape)}"


def check_option(dequantize: object) -> Block | None:
    """The block size asked for: None for ``True`` (the model's or the default), or the
    ``(rows, cols)`` given. Raise on anything else."""
    if isinstance(dequantize, bool):
        return None
    if (
        isinstance(dequantize, tuple)
        and len(dequantize) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in dequantize)
    ):
        return (dequantize[0], dequantize[1])
    raise CheckpointError(
        f"dequantize is {dequantize!r}; expected True, False, or a block size (rows, cols) "
        "of positive integers such as (128, 128)."
    )


def model_block(storage: Storage) -> Block:
    """The block size the model's ``config.json`` gives (``quantization_config``'s
    ``weight_block_size``), else 128 x 128."""
    raw = storage.read_bytes(CONFIG_FILE)
    if raw is None:
        return DEFAULT_BLOCK
    try:
        quant = json.loads(raw).get("quantization_config") or {}
        size = quant.get("weight_block_size")
    except (ValueError, AttributeError) as e:
        raise CheckpointCorruptError(
            f"{storage.location}/{CONFIG_FILE} is not a JSON object ({e}); expected a model "
            "configuration. Fix the file, or pass the block size as dequantize=(rows, cols)."
        ) from e
    if size is None:
        return DEFAULT_BLOCK
    if (
        not isinstance(size, list)
        or len(size) != 2
        or not all(isinstance(n, int) and n > 0 for n in size)
    ):
        raise CheckpointCorruptError(
            f"{storage.location}/{CONFIG_FILE} gives weight_block_size {size!r}; expected two "
            "positive integers such as [128, 128]. Fix the file, or pass the block size as "
            "dequantize=(rows, cols)."
        )
    return (size[0], size[1])
