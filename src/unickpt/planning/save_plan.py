"""The save plan: replicas written once (large ones in shares), the writing balanced across ranks.

Every rank describes what it holds (:class:`LocalPlan`); :func:`build_global_plan`, a pure
function run identically on every rank, checks that ranks holding the same key agree and that
the distinct boxes of each tensor tile it exactly, hands the boxes to their writers
(:func:`unickpt.planning.writers.assign_writers`), each plain value to the lowest rank holding
it, and lays out each rank's data file when that rank asks.

The work is per tensor and per distinct layout, never per box of every tensor: tensors that
every rank holds alike (the same kind of box list, see :mod:`.packed`) and of the same shape and
element size are one *group*, whose boxes are gathered from the ranks, deduplicated and checked
once, and written alike. At 16,384 ranks of an FSDP x TP model of 4,000 matrices (56 million
chunks) that is a few groups of 16,384 boxes each.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointMismatchError
from ..format.chunk_map import ChunkLayout, ChunkMap
from ..format.dtypes import dtype_from_name, itemsize
from ..format.index_arrays import widen
from ..layouts.boxes import Box
from ..layouts.coverage import TilingFault
from .packed import PackedPlan, box_of, pack
from .patterns import group_rows, pattern_of
from .writers import HeldBoxes, WriteLayout, assign_writers

CHUNK_ALIGN = 64
"""Chunks start at multiples of this many bytes in a data file, so any dtype views them."""


@dataclass(frozen=True)
class TensorDecl:
    """What a rank says about one tensor: its global description and the boxes it holds."""

    dtype: str
    shape: tuple[int, ...]
    layout: str
    boxes: tuple[Box, ...]


@dataclass(frozen=True)
class LocalPlan:
    """One rank's view of the state's structure.

    ``aliases`` maps a key to the key of the same tensor seen first in the state (tied weights):
    the tensor is declared once, under that first key.
    """

    tensors: dict[str, TensorDecl]
    value_keys: tuple[str, ...]
    per_rank_keys: tuple[str, ...]
    aliases: dict[str, str] = field(default_factory=dict)

    def packed(self) -> PackedPlan:
        """This plan as it is exchanged between ranks."""
        tensors = [(k, t.dtype, t.shape, t.layout, t.boxes) for k, t in self.tensors.items()]
        return pack(tensors, self.value_keys, self.per_rank_keys, self.aliases)


@dataclass(frozen=True)
class WriteItem:
    """One box a rank writes, at ``byte_offset`` of its data file. ``held`` is the box the
    rank holds that it is cut from (a share of a replicated box), None where it is that box."""

    key: str
    box: Box
    byte_offset: int
    nbytes: int
    held: Box | None = None


@dataclass(frozen=True, eq=False)
class GlobalPlan:
    """Who writes what. Each rank's file layout is computed when that rank asks for it.

    The chunks are described per layout (:class:`~unickpt.planning.writers.WriteLayout`: the
    chunks of tensors written alike, and their writers), ``layout_of`` naming the layout of
    each tensor of ``names``. ``value_writers`` names, per plain value, the rank that sends it
    at the commit (the lowest rank holding it); ``per_rank_keys`` are those of any rank.
    """

    tensors: dict[str, TensorSpec]
    itemsizes: dict[str, int]
    value_writers: dict[str, int]
    per_rank_keys: tuple[str, ...]
    aliases: dict[str, str]
    world_size: int
    names: tuple[str, ...]
    layouts: tuple[WriteLayout, ...]
    layout_of: np.ndarray
    _files: dict[int, tuple[WriteItem, ...]] = field(default_factory=dict, compare=False)
    _by_rank: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list, compare=False)
    _members: list[np.ndarray] = field(default_factory=list, compare=False)

    @property
    def chunks(self) -> int:
        """How many chunks are written, by all ranks together."""
        per_layout = np.array([len(lay.writers) for lay in self.layouts], dtype=np.int64)
        return int(per_layout[self.layout_of].sum()) if len(self.layout_of) else 0

    def members(self) -> list[np.ndarray]:
        """The tensors (positions in ``names``, ascending) of each layout."""
        if not self._members:
            order = np.argsort(self.layout_of, kind="stable")
            ends = np.searchsorted(self.layout_of[order], np.arange(len(self.layouts) + 1))
            self._members[:] = [order[a:b] for a, b in itertools.pairwise(ends.tolist())]
        return self._members

    def writes(self, rank: int) -> tuple[WriteItem, ...]:
        """The items ``rank`` writes, laid out in its file (sorted by key, then offsets)."""
        laid = self._files.get(rank)
        if laid is None:
            laid = _layout_file(self._items(rank), self.itemsizes)
            self._files[rank] = laid
        return laid

    def group_by_rank(self) -> None:
        """Sort each layout's chunks by writer once, for a caller that asks for every rank's
        writes."""
        out = []
        for lay in self.layouts:
            order = np.argsort(lay.writers, kind="stable")
            out.append((order, np.searchsorted(lay.writers[order], np.arange(self.world_size + 1))))
        self._by_rank[:] = out

    def values_of(self, rank: int) -> list[str]:
        """The plain values ``rank`` sends at the commit."""
        return [k for k, r in self.value_writers.items() if r == rank]

    def assigned(self, rank: int) -> list[tuple[str, Box]]:
        """The (key, box) pairs ``rank`` writes, in no particular order."""
        return [(k, b) for k, b, _ in self._items(rank)]

    def _items(self, rank: int) -> list[tuple[str, Box, Box | None]]:
        """(key, box, box held where it is a share) of every chunk ``rank`` writes."""
        out: list[tuple[str, Box, Box | None]] = []
        members = self.members()
        for i, lay in enumerate(self.layouts):
            if not len(members[i]):
                continue
            if self._by_rank:
                order, ends = self._by_rank[i]
                mine = order[ends[rank] : ends[rank + 1]]
            else:
                mine = np.flatnonzero(lay.writers == rank)
            if not len(mine):
                continue
            boxes = [box_of(row, lay.ndim) for row in lay.coords[mine]]
            held: list[Box | None] = [None] * len(boxes)
            if lay.held is not None:
                held = [box_of(row, lay.ndim) for row in lay.held[mine]]
            for t in members[i].tolist():
                name = self.names[t]
                out.extend((name, b, h) for b, h in zip(boxes, held))
        return out

    def chunk_map(self, files: np.ndarray) -> ChunkMap:
        """Where each chunk is listed: the chunk map of the metadata, where ``files[rank]`` is
        the position of ``rank``'s file among the checkpoint's files."""
        layouts = []
        for lay in self.layouts:
            dims = lay.coords.shape[1] // 2
            rows = lay.coords
            if lay.ndim != dims:
                rows = np.concatenate([rows[:, : lay.ndim], rows[:, dims : dims + lay.ndim]], 1)
            layouts.append(ChunkLayout(lay.ndim, rows.astype(np.int64), files[lay.writers]))
        tensors = dict(zip(self.names, self.layout_of.tolist()))
        return ChunkMap(tensors, tuple(layouts))


TensorSpec = tuple[str, tuple[int, ...], str]
"""(dtype, global shape, layout) of a tensor."""


def build_global_plan(plans: Sequence[LocalPlan | PackedPlan], share_bytes: int = 0) -> GlobalPlan:
    """Check agreement, dedup replicas, assign writers, lay out files. Same result everywhere.

    Ranks may hold different keys (pipeline stages, experts, per-rank loader states): a key is
    written by the ranks that hold it. Ranks holding the same key must agree on what it is.
    A box held by several ranks and of at least ``2 * share_bytes`` bytes is written in shares
    by several of them (``share_bytes`` 0: every box whole; see :mod:`.writers`).
    """
    packed = [p.packed() if isinstance(p, LocalPlan) else p for p in plans]
    keys = _collect_tensors(packed)
    others = _others(packed)
    value_writers, per_rank_keys = _collect_values(others, keys)
    aliases = _collect_aliases(others, keys.tensors, value_writers, per_rank_keys)
    sizes = {k: itemsize(dtype_from_name(d)) for k, (d, _, _) in keys.tensors.items()}
    names = tuple(keys.tensors)
    groups = _groups(packed, keys, sizes)
    layouts, layout_of = assign_writers(groups, names, len(packed), share_bytes)
    return GlobalPlan(
        keys.tensors,
        sizes,
        value_writers,
        per_rank_keys,
        aliases,
        len(packed),
        names,
        layouts,
        layout_of,
    )


_KINDS = {
    "replicated": "a plain tensor",
    "dtensor": "a DTensor",
    "sharded": "a ShardedTensor block",
    "flat": "a FlatShard range",
}


def _describe(dtype: str, shape: tuple[int, ...], layout: str) -> str:
    return f"{_KINDS.get(layout, layout)} {dtype}{list(shape)}"


@dataclass
class _Keys:
    """Every tensor of any rank (in the order first met) with its first holder; the distinct
    (table, kinds) pairs of the ranks (*variants*): for each, the index of each table entry's
    tensor and its kind; the variant of each rank."""

    tensors: dict[str, TensorSpec] = field(default_factory=dict)
    first: dict[str, int] = field(default_factory=dict)
    variants: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    variant_of: list[int] = field(default_factory=list)


def _collect_tensors(plans: list[PackedPlan]) -> _Keys:
    """Every tensor of any rank, checked against its first holder. Equal tables of tensors
    (ranks split alike) are read once, and equal tables and kinds counted as one variant."""
    keys = _Keys()
    index: dict[str, int] = {}
    tables: dict[bytes, np.ndarray] = {}
    variants: dict[tuple[bytes, bytes], int] = {}
    for rank, plan in enumerate(plans):
        found = variants.get((plan.table_id, plan.kinds_id))
        if found is None:
            ids = tables.get(plan.table_id)
            if ids is None:
                ids = tables[plan.table_id] = _table_ids(plan, rank, keys, index)
            found = variants[(plan.table_id, plan.kinds_id)] = len(keys.variants)
            keys.variants.append((ids, plan.kinds))
        keys.variant_of.append(found)
    return keys


def _table_ids(plan: PackedPlan, rank: int, keys: _Keys, index: dict[str, int]) -> np.ndarray:
    """The index of the tensor of each entry of ``rank``'s table; new tensors added."""
    found = []
    for key, dtype, shape, layout in plan.entries():
        spec = (dtype, shape, layout)
        known = keys.tensors.get(key)
        if known is None:
            index[key] = len(index)
            keys.tensors[key] = spec
            keys.first[key] = rank
        elif known != spec:
            raise CheckpointMismatchError(
                f"'{key}' is {_describe(*spec)} on rank {rank} but {_describe(*known)} "
                f"on rank {keys.first[key]}; ranks holding the same key must describe "
                "the same global tensor (same kind, dtype and global shape). Rename one "
                "of them if they are different tensors."
            )
        found.append(index[key])
    return np.array(found, dtype=np.int64)


def _others(plans: list[PackedPlan]) -> list[tuple[tuple[str, ...], tuple[str, ...], dict]]:
    """(value keys, per-rank keys, aliases) of each rank; equal ones parsed once."""
    seen: dict[bytes, tuple[tuple[str, ...], tuple[str, ...], dict]] = {}
    out = []
    for plan in plans:
        got = seen.get(plan.rest)
        if got is None:
            got = seen[plan.rest] = plan.others()
        out.append(got)
    return out


_Others = tuple[tuple[str, ...], tuple[str, ...], dict]


def _collect_values(others: list[_Others], keys: _Keys) -> tuple[dict[str, int], tuple[str, ...]]:
    """The lowest rank holding each plain value, and every per-rank key; kinds must agree."""
    writers: dict[str, int] = {}
    per_rank: dict[str, int] = {}
    for rank, (value_keys, per_rank_keys, _) in enumerate(others):
        for key in value_keys:
            writers.setdefault(key, rank)
        for key in per_rank_keys:
            per_rank.setdefault(key, rank)
    for key, rank in writers.items():
        if key in keys.tensors:
            _kind_clash(key, "a plain value", rank, "a tensor", keys.first[key])
        if key in per_rank:
            _kind_clash(key, "a plain value", rank, "a unickpt.PerRank value", per_rank[key])
    for key, rank in per_rank.items():
        if key in keys.tensors:
            _kind_clash(key, "a PerRank value", rank, "a tensor", keys.first[key])
    return writers, tuple(sorted(per_rank))


def _kind_clash(key: str, kind: str, rank: int, other: str, other_rank: int) -> None:
    raise CheckpointMismatchError(
        f"'{key}' is {kind} on rank {rank} but {other} on rank {other_rank}; a key must be the "
        "same kind of leaf on every rank that holds it. Rename one of them."
    )


def _collect_aliases(
    others: list[_Others],
    tensors: dict[str, TensorSpec],
    values: dict[str, int],
    per_rank: tuple[str, ...],
) -> dict[str, str]:
    """Tied keys of every rank: each names the same first key everywhere, and is no leaf."""
    aliases: dict[str, str] = {}
    origin: dict[str, int] = {}
    leaves = set(values) | set(per_rank)
    for rank, (_, _, tied) in enumerate(others):
        for key, target in tied.items():
            known = aliases.setdefault(key, target)
            origin.setdefault(key, rank)
            if known != target:
                raise CheckpointMismatchError(
                    f"'{key}' is tied to '{target}' on rank {rank} but to '{known}' on rank "
                    f"{origin[key]}; tie the same weights on every rank."
                )
            if key in tensors or key in leaves:
                raise CheckpointMismatchError(
                    f"'{key}' is tied to '{target}' on rank {rank} (one tensor under two keys) "
                    "but is a separate leaf on another rank; tie the same weights on every rank."
                )
    return aliases


class _Rows:
    """The box rows of every kind of every rank, one after the other (kinds are few per rank,
    so these are few rows), and where each (rank, kind) starts."""

    def __init__(self, plans: list[PackedPlan]) -> None:
        dims = max((p.dims for p in plans), default=0)
        self.rows = np.concatenate(
            [widen(p.coords, dims) for p in plans] or [np.zeros((0, 0), dtype=np.int64)]
        )
        kinds = np.array([len(p.counts) for p in plans], dtype=np.int64)
        self.kind_base = np.cumsum(kinds) - kinds
        self.counts = np.concatenate([p.counts for p in plans] or [np.zeros(0, np.int64)])
        self.starts = np.cumsum(self.counts) - self.counts

    def of(self, kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of kind ``kind[r]`` of each rank ``r`` (-1: none), in rank order, and the
        rank of each row."""
        ranks = np.flatnonzero(kind >= 0)
        at = self.kind_base[ranks] + kind[ranks]
        counts, starts = self.counts[at], self.starts[at]
        total = int(counts.sum())
        if total == len(ranks):  # one box each: the common case
            return self.rows[starts], ranks
        skip = np.repeat(starts - (np.cumsum(counts) - counts), counts)
        return self.rows[skip + np.arange(total)], np.repeat(ranks, counts)


def _groups(plans: list[PackedPlan], keys: _Keys, sizes: dict[str, int]) -> list[HeldBoxes]:
    """The tensors in groups held alike by every rank (the same kind on each, the same shape
    and element size), each group's boxes deduplicated and checked to tile the shape once; in
    the order of their first tensors."""
    names = list(keys.tensors)
    table = np.full((len(keys.variants), len(names)), -1, dtype=np.int64)
    for v, (ids, kinds) in enumerate(keys.variants):
        table[v, ids] = kinds
    shape_ids: dict[tuple[int, ...], int] = {}
    traits = np.array(
        [
            (shape_ids.setdefault(shape, len(shape_ids)), sizes[k])
            for k, (_, shape, _) in keys.tensors.items()
        ],
        dtype=np.int64,
    ).reshape(len(names), 2)
    first, inverse, counts = group_rows(np.concatenate([table.T, traits], axis=1))
    members = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    variant_of = np.array(keys.variant_of, dtype=np.int64)
    rows = _Rows(plans)
    groups = []
    for t, tensors in zip(first.tolist(), members):
        key = names[t]
        shape = keys.tensors[key][1]
        coords, ranks = rows.of(table[variant_of, t])
        pattern = pattern_of(shape, coords)
        if pattern.fault is not None:
            _refuse(key, shape, pattern.fault, coords, ranks)
        holders = ranks[np.argsort(pattern.inverse, kind="stable")]
        held = pattern.counts
        if pattern.replicated:
            holders, held = _once(holders, pattern.counts)
        groups.append(
            HeldBoxes(tensors, len(shape), sizes[key], coords[pattern.first], holders, held)
        )
    return groups


def _once(holders: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The holders of each box (grouped per box, ascending) with a rank that lists a box
    twice counted once."""
    box = np.repeat(np.arange(len(counts)), counts)
    keep = np.ones(len(holders), dtype=bool)
    keep[1:] = (holders[1:] != holders[:-1]) | (box[1:] != box[:-1])
    if keep.all():
        return holders, counts
    return holders[keep], np.bincount(box[keep], minlength=len(counts)).astype(np.int64)


def _refuse(
    key: str, shape: tuple[int, ...], fault: TilingFault, rows: np.ndarray, ranks: np.ndarray
) -> None:
    dims, region = rows.shape[1] // 2, fault.region
    ndim = len(shape)
    lo, n = np.array(region.offsets, dtype=np.int64), np.array(region.lengths, dtype=np.int64)
    offsets, lengths = rows[:, :ndim], rows[:, dims : dims + ndim]
    meets = ((offsets < lo + n) & (offsets + lengths > lo) & (lengths > 0)).all(axis=1)
    held = sorted(set(ranks[meets].tolist()))
    shown = ", ".join(str(r) for r in held[:8]) + (" ..." if len(held) > 8 else "")
    whose = f" (shards of ranks {shown})" if held else ""
    raise CheckpointMismatchError(
        f"the shards of '{key}' (global shape {list(shape)}) do not tile it: "
        f"{fault.describe()}{whose}. Check the offsets and global shapes passed on each "
        "rank: the distinct shards (replicas count once) must cover the tensor without gaps "
        "or overlaps."
    )


def _layout_file(
    items: list[tuple[str, Box, Box | None]], sizes: dict[str, int]
) -> tuple[WriteItem, ...]:
    offset = 0
    laid = []
    for key, box, held in sorted(items, key=lambda kb: (kb[0], kb[1].offsets)):
        nbytes = math.prod(box.lengths) * sizes[key]
        offset = -(-offset // CHUNK_ALIGN) * CHUNK_ALIGN
        laid.append(WriteItem(key, box, offset, nbytes, held))
        offset += nbytes
    return tuple(laid)


def rank_loads(plan: GlobalPlan) -> list[int]:
    """Bytes each rank writes under ``plan``."""
    load = np.zeros(plan.world_size, dtype=np.float64)
    sizes = np.array([plan.itemsizes[n] for n in plan.names], dtype=np.int64)
    for lay, members in zip(plan.layouts, plan.members()):
        weight = int(sizes[members].sum())
        load += np.bincount(lay.writers, weights=lay.numel() * weight, minlength=plan.world_size)
    return [int(x) for x in load]


__all__ = [
    "GlobalPlan",
    "LocalPlan",
    "TensorDecl",
    "WriteItem",
    "build_global_plan",
    "rank_loads",
]
