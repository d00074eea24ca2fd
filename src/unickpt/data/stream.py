"""A streaming reader of token files sharded by file over ranks, resumable on any world size.

Each rank reads whole source files (file ``i`` goes to rank ``i % world_size`` at the start),
one after the other, and cuts their tokens into samples of ``tokens_per_sample``, a sample
running from the end of one file into the next. The tokens a rank read but did not yield are
carried: once its files are read to their end, the last ones, too few for a sample, and after a
resize the carried tokens it took over. A rank's state is a cursor per source file it reads (its
path, the tokens read, its length) and the carried tokens. It is saved as a
:class:`unickpt.PerRank` value whose function, :func:`redistribute`, spreads the cursors and
carried tokens of every saving rank over the loading ranks when the world size changed: over
the whole run no token is skipped or yielded twice, whatever the world sizes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ..errors import CheckpointError, CheckpointMismatchError
from ..layouts.leaves import PerRank


@dataclass
class Cursor:
    """How far a rank read one source file: ``offset`` of its ``length`` tokens."""

    path: str
    offset: int
    length: int

    @property
    def done(self) -> bool:
        return self.offset >= self.length

    def saved(self) -> list[Any]:
        return [self.path, self.offset, self.length]


class ShardedStream(IterableDataset[torch.Tensor]):
    """Samples of ``tokens_per_sample`` tokens (int64 tensors) from this rank's share of
    ``sources``, binary files of ``dtype`` tokens (such as ``np.uint16`` arrays written with
    ``array.tofile``).

    Put the stream itself in the state (``{"data": stream}``): its :meth:`state_dict` holds a
    :class:`unickpt.PerRank` value that a load on another world size reshards through
    :func:`redistribute`. The state is taken after the samples yielded so far: iterate it
    directly, or in a DataLoader without workers (``num_workers=0``), and save between steps.
    The tokens left at the end of the stream that fill no sample are not yielded (they stay in
    :attr:`carried`).

    >>> import numpy as np  # doctest: +SKIP
    >>> from unickpt.data import ShardedStream  # doctest: +SKIP
    >>> np.arange(100, dtype=np.uint16).tofile("/tmp/shard0.bin")  # doctest: +SKIP
    >>> stream = ShardedStream(
    ...     ["/tmp/shard0.bin"], rank=0, world_size=1, tokens_per_sample=32
    ... )  # doctest: +SKIP
    >>> [len(s) for s in stream]  # doctest: +SKIP
    [32, 32, 32]
    """

    def __init__(
        self,
        sources: Sequence[str | os.PathLike[str]],
        *,
        rank: int,
        world_size: int,
        tokens_per_sample: int,
        dtype: Any = np.uint16,
    ) -> None:
        if tokens_per_sample < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise CheckpointError(
                f"ShardedStream: tokens_per_sample={tokens_per_sample}, rank={rank}, "
                f"world_size={world_size}; expected tokens_per_sample >= 1 and "
                "0 <= rank < world_size."
            )
        self.dtype = np.dtype(dtype)
        self.tokens_per_sample = tokens_per_sample
        self.sources = [str(p) for p in sources]
        mine = self.sources[rank::world_size]
        self.cursors = [Cursor(p, 0, _token_count(p, self.dtype)) for p in mine]
        self.carried = np.empty(0, dtype=np.int64)
        self._maps: dict[str, np.ndarray] = {}

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            sample = self._next_sample()
            if sample is None:
                return
            yield torch.from_numpy(sample)

    def _next_sample(self) -> np.ndarray | None:
        """The next sample, the state moved past it; None once the sources cannot fill one."""
        parts, have = [self.carried], len(self.carried)
        for cursor in self.cursors:
            if have >= self.tokens_per_sample:
                break
            take = min(self.tokens_per_sample - have, cursor.length - cursor.offset)
            if take > 0:
                parts.append(self._tokens(cursor.path)[cursor.offset : cursor.offset + take])
                cursor.offset += take
                have += take
        tokens = np.concatenate(parts).astype(np.int64)
        if len(tokens) < self.tokens_per_sample:
            self.carried = tokens  # the sources are read to their ends
            return None
        sample, self.carried = tokens[: self.tokens_per_sample], tokens[self.tokens_per_sample :]
        return sample

    def _tokens(self, path: str) -> np.ndarray:
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=self.dtype, mode="r")
        return self._maps[path]

    def state_dict(self) -> dict[str, Any]:
        """This rank's position, as a PerRank value that reshards with :func:`redistribute`."""
        value = {
            "cursors": [c.saved() for c in self.cursors],
            "carried": torch.tensor(self.carried.tolist(), dtype=torch.int64),
        }
        return {"position": PerRank(value, on_world_change=redistribute)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position (this rank's, or its share of every saving rank's)."""
        value = state["position"].value
        cursors = [Cursor(str(p), int(o), int(n)) for p, o, n in value["cursors"]]
        unknown = sorted({c.path for c in cursors} - set(self.sources))
        if unknown:
            raise CheckpointMismatchError(
                f"ShardedStream: the checkpoint's position reads {', '.join(unknown[:3])}, "
                f"which are not among this stream's {len(self.sources)} sources; pass the "
                "sources of the saved run (the same paths)."
            )
        self.cursors = cursors
        self.carried = np.asarray(value["carried"], dtype=np.int64).copy()


def redistribute(saved: list[dict[str, Any]], world_size: int, rank: int) -> dict[str, Any]:
    """This rank's share of every saving rank's stream position, for ``world_size`` ranks.

    The files not read to their end, in the order of their paths, go to the ranks in turn
    (file ``j`` to rank ``j % world_size``); the carried tokens of the ``i``-th saved position
    go to rank ``i % world_size``, before any token of its files. The same on every rank, so
    the ranks' shares hold every unread token once.
    """
    cursors = sorted(
        (c for value in saved for c in value["cursors"] if int(c[1]) < int(c[2])),
        key=lambda c: str(c[0]),
    )
    carried = [
        torch.as_tensor(value["carried"], dtype=torch.int64)
        for i, value in enumerate(saved)
        if i % world_size == rank
    ]
    return {
        "cursors": cursors[rank::world_size],
        "carried": torch.cat(carried) if carried else torch.zeros(0, dtype=torch.int64),
    }


def _token_count(path: str, dtype: np.dtype[Any]) -> int:
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise CheckpointError(
            f"ShardedStream: {path} has {size} bytes, not a whole number of {dtype} tokens "
            f"({dtype.itemsize} bytes each); pass the dtype the file was written with."
        )
    return size // dtype.itemsize
