"""Reading a tensor of a checkpoint as row-major blocks of bounded size.

Blocks come in row-major order, so writing them one after another lays out the tensor's bytes
exactly as a contiguous copy would; memory stays at one block however large the tensor is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..format.dtypes import byte_view, itemsize_of
from ..layouts.boxes import Box, split_box

if TYPE_CHECKING:
    import torch

    from ..engine.tensor_reader import CheckpointReader

MiB = 1 << 20
DEFAULT_BLOCK_BYTES = 64 * MiB


def block_boxes(shape: Sequence[int], element_bytes: int, block_bytes: int) -> list[Box]:
    """Row-major consecutive boxes of at most ``block_bytes`` covering a tensor of ``shape``."""
    whole = Box.whole(shape)
    if whole.numel == 0:
        return []
    return split_box(whole, max(1, block_bytes // max(1, element_bytes)))


def stream_tensor(
    reader: CheckpointReader,
    key: str,
    write: Callable[[memoryview], object],
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    advance: Callable[[int], None] | None = None,
) -> int:
    """Pass the bytes of tensor ``key`` to ``write`` block by block (row-major, each read and
    checksum-verified), holding one block at a time; ``advance`` gets each block's size."""
    meta = reader.metadata.tensors[key]
    size = itemsize_of(meta.value_dtype)
    done = 0
    for box in block_boxes(meta.value_shape, size, block_bytes):
        block = reader.read_tensor(key, box=box)
        write(raw_bytes(block))
        nbytes = block.numel() * block.element_size()
        del block  # before the next block is read
        done += nbytes
        if advance is not None:
            advance(nbytes)
    return done


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, for writing to a file (no copy)."""
    return byte_view(t).numpy().data


def tensor_nbytes(reader: CheckpointReader, key: str) -> int:
    meta = reader.metadata.tensors[key]
    return Box.whole(meta.value_shape).numel * itemsize_of(meta.value_dtype)
