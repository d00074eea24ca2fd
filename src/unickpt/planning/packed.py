"""A rank's save plan as it is exchanged: a few byte strings and two arrays, no object per box.

At thousands of ranks the exchanged plans hold millions of boxes; as Python objects, sending,
receiving and walking them costs minutes. Packed, a rank's tensors are one JSON table (equal
tables of different ranks are parsed once), the number of boxes per tensor, and the boxes' offsets
and lengths as one integer matrix, one row per box.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..layouts.boxes import Box

_INT32 = 1 << 31


@dataclass(frozen=True, eq=False)
class PackedPlan:
    """One rank's plan: ``table`` (JSON ``[[key, dtype, shape, layout], ...]``), ``counts``
    (boxes per table entry, int64), ``coords`` (int32 where every value fits, else int64; one
    row per box, entries in table order:
    the offsets of ``dims`` dimensions, then their lengths; a tensor of fewer dimensions is
    padded with offset 0 and length 1), ``rest`` (JSON ``[value_keys, per_rank_keys,
    aliases]``)."""

    table: bytes
    counts: np.ndarray
    coords: np.ndarray
    rest: bytes

    def signature(self) -> str:
        """A digest of the structure; equal digests mean an unchanged plan."""
        h = hashlib.blake2b(digest_size=16)
        for part in (self.table, self.counts.tobytes(), self.coords.tobytes(), self.rest):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.hexdigest()

    @property
    def dims(self) -> int:
        return int(self.coords.shape[1]) // 2

    def entries(self) -> list[tuple[str, str, tuple[int, ...], str]]:
        return [(k, d, tuple(s), lay) for k, d, s, lay in json.loads(self.table)]

    def others(self) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]:
        values, per_rank, aliases = json.loads(self.rest)
        return tuple(values), tuple(per_rank), dict(aliases)


def pack(
    tensors: list[tuple[str, str, tuple[int, ...], str, tuple[Box, ...]]],
    value_keys: tuple[str, ...],
    per_rank_keys: tuple[str, ...],
    aliases: dict[str, str],
) -> PackedPlan:
    """Pack (key, dtype, global shape, layout, boxes) of each tensor, and the other keys."""
    dims = max((len(shape) for _, _, shape, _, boxes in tensors if boxes), default=0)
    flat: list[int] = []
    for _, _, shape, _, boxes in tensors:
        pad = dims - len(shape)
        for b in boxes:
            flat.extend(b.offsets)
            flat.extend([0] * pad)
            flat.extend(b.lengths)
            flat.extend([1] * pad)
    table = json.dumps([[k, d, list(s), lay] for k, d, s, lay, _ in tensors]).encode()
    counts = np.fromiter((len(t[4]) for t in tensors), dtype=np.int64, count=len(tensors))
    coords = np.array(flat, dtype=np.int64).reshape(int(counts.sum()), 2 * dims)
    if not len(flat) or (min(flat) >= 0 and max(flat) < _INT32):
        coords = coords.astype(np.int32)  # half the bytes to send and to plan over
    return PackedPlan(table, counts, coords, encode_rest(value_keys, per_rank_keys, aliases))


def encode_rest(
    value_keys: tuple[str, ...], per_rank_keys: tuple[str, ...], aliases: dict[str, str]
) -> bytes:
    rest: list[Any] = [list(value_keys), list(per_rank_keys), sorted(aliases.items())]
    return json.dumps(rest).encode()


def widen(coords: np.ndarray, dims: int) -> np.ndarray:
    """``coords`` of fewer dimensions padded to ``dims`` (offset 0, length 1)."""
    have = coords.shape[1] // 2
    if have == dims:
        return coords
    out = np.zeros((len(coords), 2 * dims), dtype=coords.dtype)
    out[:, dims:] = 1
    out[:, :have] = coords[:, :have]
    out[:, dims : dims + have] = coords[:, have:]
    return out


def box_of(row: np.ndarray, ndim: int) -> Box:
    """The box of one coordinate row, for a tensor of ``ndim`` dimensions."""
    dims = len(row) // 2
    values = row.tolist()
    return Box(tuple(values[:ndim]), tuple(values[dims : dims + ndim]))
