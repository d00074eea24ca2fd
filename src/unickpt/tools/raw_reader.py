"""Reading boxes of a checkpoint's tensors as raw element bytes in NumPy arrays, without torch.

The command line's ``diff`` compares two checkpoints through it, so that it starts without
importing torch. A box is filled from the saved chunks that overlap it (the same index the
load uses), each overlap read as one span of the chunk's bytes (whole checksum segments, each
verified, when verifying; the stored segments of a compressed chunk, decoded), then copied
into place. A quantized table is decoded by the torch reader (torch is imported then).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import numpy as np

from ..engine.checksum import ChunkRef, check_buffer
from ..engine.commit import read_checkpoint
from ..engine.compress import read_packed
from ..engine.references import resolving
from ..errors import CheckpointCorruptError, CheckpointMismatchError
from ..format.dtypes import itemsize_of
from ..format.metadata import ChunkMeta, CommitRecord, Metadata
from ..layouts.boxes import Box, row_major_strides
from ..planning.exchange_plan import flat_span
from ..planning.load_plan import ChunkIndex, check_chunks_tile
from ..storage.base import Storage
from ..storage.registry import open_storage

if TYPE_CHECKING:
    from ..engine.tensor_reader import CheckpointReader


class RawReader:
    """A committed checkpoint whose tensors are read as raw bytes: ``read_box`` gives a uint8
    array of shape ``box.lengths + (itemsize,)``.

    >>> with RawReader("ckpt/step-100") as r:  # doctest: +SKIP
    ...     block = r.read_box("model.w", Box((0, 0), (16, 8)))
    """

    def __init__(self, path: str | os.PathLike[str] | Storage, *, verify: bool = True) -> None:
        self.storage = resolving(open_storage(path))
        self.commit: CommitRecord
        self.metadata: Metadata
        self.commit, self.metadata = read_checkpoint(self.storage)
        self.verify = verify
        self.bytes_read = 0
        self._indexes: dict[str, ChunkIndex] = {}
        self._decoder: CheckpointReader | None = None

    def read_box(self, key: str, box: Box) -> np.ndarray:
        """The bytes of ``box`` of tensor ``key`` (a tied key reads the tensor it is tied to)."""
        meta = self.metadata.tensor(key)
        if meta is None:
            raise CheckpointMismatchError(
                f"'{key}' is not a tensor of this checkpoint; see `unickpt inspect` for its keys."
            )
        size = itemsize_of(meta.value_dtype)
        if meta.encoding is not None:
            return self._decoded(key, box, size)
        stored = self.metadata.aliases.get(key, key)
        index = self._indexes.get(stored)
        if index is None:
            index = self._indexes[stored] = check_chunks_tile(stored, meta)
        out = np.empty((*box.lengths, size), dtype=np.uint8)
        covered = 0
        for chunk, overlap in index.overlapping(box):
            self._place(stored, chunk, overlap, size, out[overlap.relative_to(box)])
            covered += overlap.numel
        if covered != box.numel:
            raise CheckpointCorruptError(
                f"'{key}': the saved chunks hold {covered} of the {box.numel} elements of the "
                f"box at {list(box.offsets)}; the checkpoint's indexes do not describe its data. "
                "Load an earlier checkpoint."
            )
        return out

    def _place(self, key: str, chunk: ChunkMeta, region: Box, size: int, dest: np.ndarray) -> None:
        """Read ``region`` of ``chunk`` (one span of its bytes) into ``dest``."""
        first, end = flat_span(chunk, region) if region.ndim else (0, 1)
        lo, hi = first * size, end * size
        if (self.verify and chunk.checksums) or chunk.compression is not None:
            seg = self.metadata.segment_bytes
            lo, hi = lo // seg * seg, min(math.ceil(hi / seg) * seg, chunk.nbytes)
        span = self._read_span(key, chunk, lo, hi)
        strides = (*(s * size for s in row_major_strides(chunk.lengths)), 1)
        src = np.lib.stride_tricks.as_strided(
            span[first * size - lo :], (*region.lengths, size), strides, writeable=False
        )
        np.copyto(dest, src)

    def _read_span(self, key: str, chunk: ChunkMeta, lo: int, hi: int) -> np.ndarray:
        file = self.metadata.files[chunk.file]
        out = np.empty(hi - lo, dtype=np.uint8)
        seg = self.metadata.segment_bytes
        if chunk.compression is not None:
            read_packed(self.storage, file, key, chunk, lo, out, self.verify, seg)
        else:
            view = memoryview(out)  # type: ignore[arg-type]
            self.storage.read_into(file, chunk.byte_offset + lo, view)
            if self.verify and chunk.checksums:
                check_buffer(ChunkRef(key, file, chunk), lo, view, seg)
        self.bytes_read += hi - lo
        return out

    def _decoded(self, key: str, box: Box, size: int) -> np.ndarray:
        """A quantized table's box, decoded by the torch reader."""
        if self._decoder is None:
            from ..engine.tensor_reader import CheckpointReader

            self._decoder = CheckpointReader(self.storage, verify=self.verify)
        from ..format.dtypes import byte_view

        values = self._decoder.read_tensor(key, box=box)
        return byte_view(values).numpy().reshape(*box.lengths, size)

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> RawReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
