"""What the readers of foreign checkpoints share."""

from __future__ import annotations

import torch

from ..format.metadata import Metadata

FORMAT_KEY = "foreign_format"
"""The producer entry that marks metadata translated from another format (its name)."""
SEGMENT_BYTES = 1 << 20
"""The segment size given to translated metadata (its chunks have no checksums)."""


def foreign_format(meta: Metadata) -> str | None:
    """The format ``meta`` was translated from (``safetensors``, ``dcp``), or None."""
    return meta.producer.get(FORMAT_KEY)


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
"""safetensors' dtype names."""
