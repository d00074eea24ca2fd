"""Reading a checkpoint tensor by tensor, without a state to load into (tools, conversion)."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..config import Config, get_config
from ..encoding.reading import DecodeItem, plan_encoded_reads
from ..errors import CheckpointMismatchError
from ..format.dtypes import dtype_from_name
from ..format.metadata import CommitRecord, Metadata
from ..format.values import decode_value
from ..layouts.boxes import Box
from ..planning.load_plan import ChunkIndex, check_chunks_tile, plan_reads
from ..storage.base import Storage
from ..storage.registry import open_storage
from .commit import read_checkpoint
from .read_chunks import ReadStats, execute_reads
from .references import resolving


class CheckpointReader:
    """Open a committed checkpoint and read whole tensors or values from it.

    >>> reader = CheckpointReader("ckpt/step-100")  # doctest: +SKIP
    >>> reader.keys()  # doctest: +SKIP
    >>> w = reader.read_tensor("model.layers.0.weight")  # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Storage,
        *,
        verify: bool = True,
        config: Config | None = None,
    ) -> None:
        self.storage = resolving(open_storage(path))
        self.commit: CommitRecord
        self.metadata: Metadata
        self.commit, self.metadata = read_checkpoint(self.storage)
        self.config = config or get_config()
        self.verify = verify
        self.bytes_read = 0
        self._indexes: dict[str, ChunkIndex] = {}

    def keys(self) -> list[str]:
        """Every key: tensors (tied keys included), values, per-rank values."""
        return sorted(self.metadata.keys())

    def read_tensor(
        self, key: str, out: torch.Tensor | None = None, box: Box | None = None
    ) -> torch.Tensor:
        """The whole tensor ``key`` (or the ``box`` of it) as a CPU tensor; a tied key reads
        the tensor it is tied to, a quantized table is decoded."""
        meta = self.metadata.tensor(key)
        if meta is None:
            raise CheckpointMismatchError(
                f"'{key}' is not a tensor of this checkpoint; see `unickpt inspect` for its keys."
            )
        stored = self.metadata.aliases.get(key, key)
        index = self._indexes.get(stored)
        if index is None:
            index = self._indexes[stored] = check_chunks_tile(stored, meta)
        box = box or Box.whole(meta.value_shape)
        if out is None:
            out = torch.empty(box.lengths, dtype=dtype_from_name(meta.value_dtype))
        if not box.numel:
            return out
        decodes: list[DecodeItem] = []
        if meta.encoding is None:
            items = plan_reads(stored, meta, self.metadata.files, [(box, out)], index)
        else:
            encoded = plan_encoded_reads(stored, meta, self.metadata.files, [(box, out)], index)
            items, decodes = encoded.reads, encoded.decodes
        stats: ReadStats = execute_reads(
            self.storage, items, self.config, self.verify, self.metadata.segment_bytes
        )
        for decode in decodes:
            decode.run()
        self.bytes_read += stats.bytes_read
        return out

    def read_value(self, key: str, rank: int = 0, allow_pickle: bool = False) -> Any:
        """A stored Python value (for per-rank values: that of ``rank``)."""
        if key in self.metadata.objects:
            return decode_value(self.metadata.objects[key], key, allow_pickle)
        if key in self.metadata.per_rank:
            found, encoded = self.metadata.per_rank_value(key, rank)
            if not found:
                raise CheckpointMismatchError(
                    f"'{key}' holds no value of rank {rank} (the checkpoint has values of "
                    f"ranks {self.per_rank_ranks(key)})."
                )
            return decode_value(encoded, key, allow_pickle)
        raise CheckpointMismatchError(f"'{key}' is not a value of this checkpoint.")

    def per_rank_ranks(self, key: str) -> list[int]:
        """The ranks that saved a value under per-rank ``key``."""
        m = self.metadata
        return [r for r in range(len(m.per_rank.get(key, ()))) if m.per_rank_value(key, r)[0]]

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
