"""Bounds on what metadata and index files may ask a reader to allocate.

Counts and sizes read from a checkpoint's files (dimensions, rows of the chunk map, world size,
tensor bytes) are checked against these bounds, or against what the files' own sizes can
justify, before anything is allocated or inflated: a damaged or forged file is refused with
:class:`~unickpt.errors.CheckpointCorruptError` at a cost proportional to its size.
"""

from __future__ import annotations

from ..errors import CheckpointCorruptError

MAX_NDIM = 64
"""The most dimensions a stored tensor may have (torch's kernels handle at most 25)."""
MAX_WORLD_SIZE = 1 << 24
"""The most ranks a checkpoint may have been saved from."""
MAX_TENSOR_BYTES = 1 << 56
"""The most bytes one stored tensor may have (64 PiB): shapes beyond it are damage."""
CHUNK_MAP_ROW_INDEX_BYTES = 8
"""An index lists each chunk in more bytes than this (its key, numbers and checksum), so an
index of ``n`` bytes lists fewer than ``n / 8`` chunks: a chunk map may have no more rows."""
MAX_CHUNK_MAP_BYTES = 128 << 20
"""The most bytes a chunk map may decode to (4 million boxes of 2-D tensors once equal layouts
are shared), whatever its indexes justify; a larger map is not used (readers then read every
index, which holds the same boxes)."""


def check_ndim(ndim: int, what: str, source: str) -> None:
    """Refuse ``what`` (a tensor, a chunk) of ``ndim`` dimensions outside ``[0, MAX_NDIM]``."""
    if not 0 <= ndim <= MAX_NDIM:
        raise CheckpointCorruptError(
            f"{source}: {what} has {ndim} dimensions; unickpt stores tensors of 0 to {MAX_NDIM} "
            "dimensions. The file is damaged. Load an earlier checkpoint."
        )
