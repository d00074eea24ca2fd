"""The safetensors layout, written directly so a file streams out tensor by tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and ``data_offsets`` (relative to the end of the header), then the raw
little-endian bytes back to back. The header is padded with spaces to a multiple of 8 bytes and
tensors are ordered by decreasing element size, so every tensor is aligned to its element.
Sharded output follows Hugging Face: ``model-00001-of-00003.safetensors`` files and a
``model.safetensors.index.json`` with ``metadata.total_size`` and a ``weight_map``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from .common import DTYPE_NAMES as DTYPE_NAMES
from .common import INDEX_FILE as INDEX_FILE
from .common import SINGLE_FILE as SINGLE_FILE


def shard_name(index: int, count: int) -> str:
    """The Hugging Face name of shard ``index`` (0-based) of ``count``."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its name, dtype, shape and size in bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def order_entries(entries: list[Entry]) -> list[Entry]:
    """The order tensors are written in: larger elements first (keeps each aligned), then name."""
    return sorted(entries, key=lambda e: (-e.dtype.itemsize, e.name))


def encode_header(ordered: list[Entry], metadata: dict[str, str]) -> bytes:
    """Length prefix plus padded JSON header for ``ordered`` entries written in that order."""
    doc: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for e in ordered:
        doc[e.name] = {
            "dtype": DTYPE_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def plan_shards(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Fill shards in name order, starting a new one when the next tensor would pass the limit
    (a tensor larger than the limit gets a shard of its own), as Hugging Face does."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in sorted(entries, key=lambda e: e.name):
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards
