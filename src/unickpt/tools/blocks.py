"""Reading a tensor of a checkpoint as row-major blocks of bounded size.

Blocks come in row-major order, so writing them one after another lays out the tensor's bytes
exactly as a contiguous copy would; memory stays at one block however large the tensor is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..engine.read import split_box
from ..engine.reader import CheckpointReader
from ..format.dtypes import byte_view, dtype_from_name, itemsize
from ..layouts.boxes import Box

MiB = 1 << 20
DEFAULT_BLOCK_BYTES = 64 * MiB


def block_boxes(shape: Sequence[int], element_bytes: int, block_bytes: int) -> list[Box]:
    """Row-major consecutive boxes of at most ``block_bytes`` covering a tensor of ``shape``."""
    whole = Box.whole(shape)
    if whole.numel == 0:
        return []
    return split_box(whole, max(1, block_bytes // max(1, element_bytes)))


def iter_blocks(
    reader: CheckpointReader, key: str, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> Iterator[tuple[Box, torch.Tensor]]:
    """Each block of tensor ``key`` with its box, read (and checksum-verified) one at a time."""
    meta = reader.metadata.tensors[key]
    size = itemsize(dtype_from_name(meta.dtype))
    for box in block_boxes(meta.shape, size, block_bytes):
        yield box, reader.read_tensor(key, box=box)


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, for writing to a file (no copy)."""
    return byte_view(t).numpy().data


def tensor_nbytes(reader: CheckpointReader, key: str) -> int:
    meta = reader.metadata.tensors[key]
    return Box.whole(meta.shape).numel * itemsize(dtype_from_name(meta.dtype))
