"""A rank's save plan as it is exchanged: a few byte strings and small arrays, no object per box.

At thousands of ranks the exchanged plans hold millions of boxes; as Python objects, sending,
receiving and walking them costs minutes. Packed, a rank's tensors are one JSON table (equal
tables of different ranks are parsed once), and the boxes it holds are factored: the tensors a
rank holds alike (every layer's ``w1`` cut the same way) share one *kind*, a list of boxes
stored once as rows of an integer matrix, and each tensor names its kind. A rank of a model
split alike sends a handful of rows however many tensors it holds, and ranks split alike send
equal tables and kinds, which the planner reads once (:mod:`unickpt.planning.save_plan`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..layouts.boxes import Box
from .patterns import group_rows

_INT32 = 1 << 31


@dataclass(frozen=True, eq=False)
class PackedPlan:
    """One rank's plan.

    ``table``: JSON ``[[key, dtype, shape, layout], ...]``. ``kinds``: per table entry, the
    kind of box list it holds (int32). ``counts``: boxes per kind (int64). ``coords``: the boxes
    of each kind, kind after kind (int32 where every value fits, else int64; one row per box:
    the offsets of ``dims`` dimensions, then their lengths; a box of fewer dimensions is padded
    with offset 0 and length 1). ``rest``: JSON ``[value_keys, per_rank_keys, aliases]``.
    ``table_id`` and ``kinds_id`` are digests of the table and of the kinds, computed by the
    rank that packs the plan, so that a planner tells equal ones apart without comparing them.
    """

    table: bytes
    kinds: np.ndarray
    counts: np.ndarray
    coords: np.ndarray
    rest: bytes
    table_id: bytes
    kinds_id: bytes

    def signature(self) -> str:
        """A digest of the structure; equal digests mean an unchanged plan."""
        h = hashlib.blake2b(digest_size=16)
        parts = (self.table_id, self.kinds_id, self.counts.tobytes(), self.coords.tobytes())
        for part in (*parts, str(self.coords.dtype).encode(), self.rest):
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


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def packed(
    table: bytes, kinds: np.ndarray, counts: np.ndarray, coords: np.ndarray, rest: bytes
) -> PackedPlan:
    """A plan of these parts, with their digests (int32 coordinates where they fit)."""
    if not coords.size or (int(coords.min()) >= 0 and int(coords.max()) < _INT32):
        coords = coords.astype(np.int32)  # half the bytes to send and to plan over
    kinds = np.ascontiguousarray(kinds, dtype=np.int32)
    return PackedPlan(
        table,
        kinds,
        counts.astype(np.int64),
        coords,
        rest,
        _digest(table),
        _digest(kinds.tobytes()),
    )


def pack(
    tensors: list[tuple[str, str, tuple[int, ...], str, tuple[Box, ...]]],
    value_keys: tuple[str, ...],
    per_rank_keys: tuple[str, ...],
    aliases: dict[str, str],
) -> PackedPlan:
    """Pack (key, dtype, global shape, layout, boxes) of each tensor, and the other keys."""
    dims = max((len(shape) for _, _, shape, _, boxes in tensors if boxes), default=0)
    kind_of: dict[tuple[Box, ...], int] = {}
    kinds: list[int] = []
    flat: list[int] = []
    counts: list[int] = []
    for _, _, shape, _, boxes in tensors:
        kind = kind_of.get(boxes)
        if kind is None:
            kind = kind_of[boxes] = len(kind_of)
            counts.append(len(boxes))
            pad = dims - len(shape)
            for b in boxes:
                flat.extend(b.offsets)
                flat.extend([0] * pad)
                flat.extend(b.lengths)
                flat.extend([1] * pad)
        kinds.append(kind)
    table = json.dumps([[k, d, list(s), lay] for k, d, s, lay, _ in tensors]).encode()
    coords = np.array(flat, dtype=np.int64).reshape(sum(counts), 2 * dims)
    rest = encode_rest(value_keys, per_rank_keys, aliases)
    return packed(table, np.array(kinds), np.array(counts, dtype=np.int64), coords, rest)


def pack_single(table: bytes, held: np.ndarray, coords: np.ndarray, rest: bytes) -> PackedPlan:
    """Pack a rank holding at most one box of each tensor, given as arrays: ``held`` (a mask
    over the table's entries) and ``coords`` (the box of each held entry, in order)."""
    if not len(coords):
        kinds = np.zeros(len(held), dtype=np.int32)
        return packed(table, kinds, np.array([0], np.int64), coords, rest)
    first, inverse, _ = group_rows(coords)  # kinds numbered as first met
    none = len(first) if not held.all() else -1  # the kind of the entries holding nothing
    kinds = np.full(len(held), none, dtype=np.int32)
    kinds[held] = inverse
    counts = np.ones(len(first) + (none >= 0), dtype=np.int64)
    if none >= 0:
        counts[none] = 0
    return packed(table, kinds, counts, coords[first], rest)


def first_holders(ids: Sequence[tuple[bytes, bytes]]) -> dict[bytes, int]:
    """The lowest rank sending each distinct table and kinds, from every rank's ``(table_id,
    kinds_id)``: keys are ``b"t" + table_id`` and ``b"k" + kinds_id``."""
    owners: dict[bytes, int] = {}
    for rank, (table_id, kinds_id) in enumerate(ids):
        owners.setdefault(b"t" + table_id, rank)
        owners.setdefault(b"k" + kinds_id, rank)
    return owners


def without_shared(plan: PackedPlan) -> PackedPlan:
    """``plan`` without its table and kinds (sent once for all ranks holding them alike)."""
    return replace(plan, table=b"", kinds=np.zeros(0, dtype=np.int32))


def shared_parts(plan: PackedPlan, owners: dict[bytes, int], rank: int) -> dict[bytes, Any]:
    """The table and kinds of ``plan`` that ``rank`` sends for every rank (see
    :func:`first_holders`)."""
    out: dict[bytes, Any] = {}
    if owners[b"t" + plan.table_id] == rank:
        out[b"t" + plan.table_id] = plan.table
    if owners[b"k" + plan.kinds_id] == rank:
        out[b"k" + plan.kinds_id] = plan.kinds
    return out


def with_shared(plan: PackedPlan, parts: dict[bytes, Any]) -> PackedPlan:
    """A plan of :func:`without_shared` given back its table and kinds."""
    return replace(plan, table=parts[b"t" + plan.table_id], kinds=parts[b"k" + plan.kinds_id])


def encode_rest(
    value_keys: tuple[str, ...], per_rank_keys: tuple[str, ...], aliases: dict[str, str]
) -> bytes:
    rest: list[Any] = [list(value_keys), list(per_rank_keys), sorted(aliases.items())]
    return json.dumps(rest).encode()


def box_of(row: np.ndarray, ndim: int) -> Box:
    """The box of one coordinate row, for a tensor of ``ndim`` dimensions."""
    dims = len(row) // 2
    values = row.tolist()
    return Box(tuple(values[:ndim]), tuple(values[dims : dims + ndim]))
