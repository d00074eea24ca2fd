"""The leaf types a user puts into a state to describe how a tensor is split across ranks."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError


@dataclass
class ShardedTensor:
    """A regular block of a global tensor, as Megatron-style tensor parallelism makes.

    ``local`` holds the block ``[offsets, offsets + local.shape)`` of a tensor of
    ``global_shape``. Ranks that hold the same block are replicas; it is written once.

    >>> import torch, unickpt
    >>> w = torch.zeros(4, 8)
    >>> leaf = unickpt.ShardedTensor(w, global_shape=(4, 16), offsets=(0, 8))
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.offsets = tuple(int(o) for o in self.offsets)
        shape = tuple(self.local.shape)
        if len(shape) != len(self.global_shape) or len(self.offsets) != len(shape):
            raise CheckpointError(
                f"ShardedTensor: local shape {shape}, global_shape {self.global_shape} and "
                f"offsets {self.offsets} must have the same number of dimensions; pass one "
                "offset per dimension of the global tensor."
            )
        for d, (o, n, g) in enumerate(zip(self.offsets, shape, self.global_shape)):
            if o < 0 or o + n > g:
                raise CheckpointError(
                    f"ShardedTensor: dimension {d} covers [{o}, {o + n}) but the global size is "
                    f"{g}; the block must lie inside global_shape {self.global_shape}."
                )


@dataclass
class FlatShard:
    """A contiguous range of the row-major flattening of a global tensor, cut anywhere.

    ``local`` (any shape, its elements taken in row-major order) holds elements
    ``[flat_offset, flat_offset + local.numel())`` of a tensor of ``global_shape``. This is
    what FSDP1 flat parameters, ZeRO and distributed optimizers hold.

    >>> import torch, unickpt
    >>> part = torch.zeros(10)  # elements 7..16 of a 4x6 matrix
    >>> leaf = unickpt.FlatShard(part, global_shape=(4, 6), flat_offset=7)
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    flat_offset: int

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.flat_offset = int(self.flat_offset)
        total = math.prod(self.global_shape)
        end = self.flat_offset + self.local.numel()
        if self.flat_offset < 0 or end > total:
            raise CheckpointError(
                f"FlatShard: elements [{self.flat_offset}, {end}) lie outside a global tensor "
                f"of {total} elements (shape {self.global_shape}); check flat_offset and the "
                "local tensor's size (strip padding before saving)."
            )


Reshard = Callable[[list[Any], int, int], Any]
"""``fn(saved_values, world_size, rank) -> value``: a PerRank value's resharding function."""


@dataclass
class PerRank:
    """A value that differs per rank (RNG state, a data position): restored to the same rank.

    Load replaces ``value`` with the one this rank saved. When the world size changed since the
    save (or some rank held no value under the key then), ``on_world_change`` decides:

    - ``"warn"`` (default): ranks with a saved value get it back, the others keep their current
      value, and a warning says so once per key;
    - ``"error"``: the load is refused;
    - a function ``fn(saved_values, world_size, rank) -> value``: every loading rank gets
      ``fn``'s result, from ``saved_values`` (the decoded values of the saving ranks that held
      one, in rank order; a warning names the ranks that held none), the loading world size and
      its own rank. It must be deterministic, so that the ranks agree on how the values are
      split. At the saved world size, every rank having held a value, each rank gets its own
      value back and ``fn`` is not called. An error of ``fn`` fails the load on every rank, the
      key named.

    >>> import torch, unickpt
    >>> state = {"rng": unickpt.PerRank(torch.get_rng_state())}
    >>> # after unickpt.load(path, state): torch.set_rng_state(state["rng"].value)
    >>> def concat(saved, world_size, rank):  # every rank's list, split anew
    ...     merged = [x for values in saved for x in values]
    ...     return merged[rank::world_size]
    >>> todo = unickpt.PerRank([1, 2, 3], on_world_change=concat)
    """

    value: Any = field(default=None)
    on_world_change: str | Reshard = "warn"

    def __post_init__(self) -> None:
        if not callable(self.on_world_change) and self.on_world_change not in ("warn", "error"):
            raise CheckpointError(
                f"PerRank(on_world_change={self.on_world_change!r}): expected 'warn' (keep the "
                "current value where none was saved), 'error' (refuse the load) or a function "
                "fn(saved_values, world_size, rank) returning this rank's value."
            )


def is_flat_source(value: Any) -> bool:
    return isinstance(value, FlatShard)


def tensor_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def check_same_ndim(shape: Sequence[int], other: Sequence[int]) -> bool:
    return len(shape) == len(other)
