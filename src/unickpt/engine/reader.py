"""Reading a checkpoint tensor by tensor, without a state to load into (tools, conversion)."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..config import Config, get_config
from ..errors import CheckpointMismatchError
from ..format.dtypes import dtype_from_name
from ..format.metadata import CommitRecord, Metadata
from ..format.values import decode_value
from ..layouts.boxes import Box
from ..planning.load_plan import plan_reads
from ..storage.base import Storage
from ..storage.registry import open_storage
from .commit import read_checkpoint
from .read import ReadStats, execute_reads
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

    def keys(self) -> list[str]:
        m = self.metadata
        return sorted(set(m.tensors) | set(m.objects) | set(m.per_rank))

    def read_tensor(
        self, key: str, out: torch.Tensor | None = None, box: Box | None = None
    ) -> torch.Tensor:
        """The whole tensor ``key`` (or the ``box`` of it) as a CPU tensor."""
        meta = self.metadata.tensors.get(key)
        if meta is None:
            raise CheckpointMismatchError(
                f"'{key}' is not a tensor of this checkpoint; see `unickpt inspect` for its keys."
            )
        box = box or Box.whole(meta.shape)
        if out is None:
            out = torch.empty(box.lengths, dtype=dtype_from_name(meta.dtype))
        if box.numel:
            items = plan_reads(key, meta, self.metadata.files, [(box, out)])
            stats: ReadStats = execute_reads(
                self.storage, items, self.config, self.verify, self.metadata.segment_bytes
            )
            self.bytes_read += stats.bytes_read
        return out

    def read_value(self, key: str, rank: int = 0, allow_pickle: bool = False) -> Any:
        """A stored Python value (for per-rank values: that of ``rank``)."""
        if key in self.metadata.objects:
            return decode_value(self.metadata.objects[key], key, allow_pickle)
        if key in self.metadata.per_rank:
            return decode_value(self.metadata.per_rank[key][rank], key, allow_pickle)
        raise CheckpointMismatchError(f"'{key}' is not a value of this checkpoint.")

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
