"""The leaf types a user puts into a state to describe how a tensor is split across ranks."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..errors import CheckpointError
from .boxes import Box
from .dtensor import is_dtensor


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


class FusedPiece(NamedTuple):
    """One piece of a :class:`Fused` tensor: ``length`` slices along the fused dimension that
    hold the box at ``offsets`` of the global tensor ``{key}.{name}`` of ``global_shape``."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    length: int


@dataclass
class Fused:
    """A local tensor made of pieces of several logical tensors, concatenated along ``dim``.

    Piece ``k`` is ``local.narrow(dim, sum of the earlier lengths, length)``: the box at
    ``offsets`` of the global tensor ``{key}.{name}`` (``key`` is where the leaf sits in the
    state), its shape the piece's shape. Several pieces may name one global tensor (Q of two
    query groups on one rank). The pieces are saved as those global tensors, so a checkpoint
    saved at one tensor-parallel size loads at any other, or into a model that holds
    ``{key}.{name}`` unfused. A piece named ``""`` is a box of the global tensor ``{key}``
    itself (several boxes of one tensor held in one local tensor, as Megatron's SwiGLU
    factories make). Loads write into ``local`` in place.

    >>> import torch, unickpt
    >>> local = torch.zeros(4, 8)  # rank 1 of 2: rows 2-3 of gate, then rows 2-3 of up
    >>> leaf = unickpt.Fused(local, dim=0, pieces=[
    ...     ("gate", (4, 8), (2, 0), 2), ("up", (4, 8), (2, 0), 2)])
    """

    local: torch.Tensor
    dim: int
    pieces: list[FusedPiece]

    def __post_init__(self) -> None:
        ndim = self.local.dim()
        if ndim == 0 or not -ndim <= int(self.dim) < ndim:
            raise CheckpointError(
                f"Fused: dim {self.dim} is not a dimension of the local tensor of shape "
                f"{tensor_shape(self.local)}; pass the dimension the pieces are concatenated along."
            )
        self.dim = int(self.dim) % ndim
        self.pieces = [self._piece(p) for p in self.pieces]
        total = sum(p.length for p in self.pieces)
        if total != self.local.shape[self.dim]:
            raise CheckpointError(
                f"Fused: the pieces' lengths sum to {total} but the local tensor has "
                f"{self.local.shape[self.dim]} along dim {self.dim} (shape "
                f"{tensor_shape(self.local)}); list every piece the local tensor holds, in order."
            )
        shapes: dict[str, tuple[int, ...]] = {}
        for p in self.pieces:
            if shapes.setdefault(p.name, p.global_shape) != p.global_shape:
                raise CheckpointError(
                    f"Fused: pieces of '{p.name}' give global shapes {shapes[p.name]} and "
                    f"{p.global_shape}; every piece of one tensor must give its same global shape."
                )

    def _piece(self, raw: Any) -> FusedPiece:
        try:
            name, global_shape, offsets, length = raw
            p = FusedPiece(
                str(name),
                tuple(int(s) for s in global_shape),
                tuple(int(o) for o in offsets),
                int(length),
            )
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"Fused: piece {raw!r} is not (name, global_shape, offsets, length) ({e})."
            ) from None
        shape = self.piece_shape(p)
        if len(p.global_shape) != len(shape) or len(p.offsets) != len(shape):
            raise CheckpointError(
                f"Fused: piece {p.name!r} has global_shape {p.global_shape} and offsets "
                f"{p.offsets} for a local tensor of {len(shape)} dimensions; give one size and "
                "one offset per dimension."
            )
        if p.length < 0 or not Box(p.offsets, shape).within(p.global_shape):
            raise CheckpointError(
                f"Fused: piece {p.name!r} covers the box at {p.offsets} of shape {shape}, which "
                f"does not lie inside its global_shape {p.global_shape}; check its offsets and "
                "length."
            )
        return p

    def piece_shape(self, piece: FusedPiece) -> tuple[int, ...]:
        """The shape of ``piece`` in the local tensor."""
        shape = list(tensor_shape(self.local))
        shape[self.dim] = piece.length
        return tuple(shape)


@dataclass
class Padded:
    """A tensor whose logical size ``global_shape`` is smaller than the one it is held at.

    ``leaf`` is a plain tensor, a DTensor or a :class:`ShardedTensor`, padded along any
    dimensions (a vocabulary padded to a multiple of the tensor-parallel size). Only the
    region inside ``global_shape`` is saved and loaded; padding keeps its values. The
    checkpoint holds the logical shape, so it loads at any padding.

    >>> import torch, unickpt
    >>> emb = torch.zeros(1024, 16)  # a vocabulary of 1000 padded to 1024
    >>> leaf = unickpt.Padded(emb, global_shape=(1000, 16))
    """

    leaf: Any
    global_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        if isinstance(self.leaf, ShardedTensor):
            held = self.leaf.global_shape
        elif isinstance(self.leaf, torch.Tensor):
            held = tensor_shape(self.leaf)  # a DTensor's shape is its global shape
        else:
            raise CheckpointError(
                f"Padded: the leaf is a {type(self.leaf).__name__}; expected a tensor, a DTensor "
                "or a unickpt.ShardedTensor."
            )
        if len(held) != len(self.global_shape) or any(
            n < 0 or n > h for n, h in zip(self.global_shape, held)
        ):
            raise CheckpointError(
                f"Padded: the logical global_shape {self.global_shape} does not fit in the padded "
                f"shape {held}; pass one size per dimension, each at most the padded size."
            )


@dataclass
class Replicated:
    """A tensor every rank holding it should hold alike (tensor-parallel LayerNorm weights).

    At save, ``reduce="check"`` compares the copies across the ranks holding it and fails the
    save on every rank, naming the key and the largest difference, when they differ;
    ``reduce="mean"`` saves their mean. A load gives every rank the saved value.

    >>> import torch, unickpt
    >>> leaf = unickpt.Replicated(torch.ones(16), reduce="mean")
    """

    tensor: torch.Tensor
    reduce: str = "check"

    def __post_init__(self) -> None:
        if self.reduce not in ("check", "mean"):
            raise CheckpointError(
                f"Replicated(reduce={self.reduce!r}): expected 'check' (fail the save when the "
                "copies differ) or 'mean' (save their mean)."
            )
        if not isinstance(self.tensor, torch.Tensor) or is_dtensor(self.tensor):
            raise CheckpointError(
                f"Replicated: expected the plain tensor this rank holds, got a "
                f"{type(self.tensor).__name__}."
            )
        if self.reduce == "mean" and not self.tensor.is_floating_point():
            raise CheckpointError(
                f"Replicated(reduce='mean') of a {self.tensor.dtype} tensor: a mean needs a "
                "floating dtype; use reduce='check' for integer values."
            )


LAYOUT_LEAVES = (Fused, Padded, Replicated)
"""The leaves that describe how one tensor is laid out beyond its sharding."""


def tensor_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)
