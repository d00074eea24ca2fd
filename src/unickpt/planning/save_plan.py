"""The save plan: replicas written once, the writing balanced across ranks.

Every rank describes what it holds (:class:`LocalPlan`); :func:`build_global_plan`, a pure
function run identically on every rank, checks that ranks holding the same key agree and that
the distinct boxes of each tensor tile it exactly, gives each distinct box to the least-loaded
rank holding it (largest first), each plain value to the lowest rank holding it, and lays out
each rank's data file.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointMismatchError
from ..format.dtypes import dtype_from_name, itemsize
from ..layouts.arrays import distinct
from ..layouts.boxes import Box
from ..layouts.coverage import TilingFault
from .packed import PackedPlan, box_of, pack, widen
from .patterns import Pattern, pattern_of

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
    """One box a rank writes, at ``byte_offset`` of its data file."""

    key: str
    box: Box
    byte_offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class GlobalPlan:
    """Who writes what. Each rank's file layout is computed when that rank asks for it.

    The distinct boxes of all tensors are arrays, one entry per box: ``box_keys`` (an index into
    ``names``), ``box_coords`` (packed offsets and lengths, see :mod:`.packed`) and
    ``box_writers`` (the rank that writes it). ``value_writers`` names, per plain value, the
    rank that sends it at the commit (the lowest rank holding it); ``per_rank_keys`` are those
    of any rank.
    """

    tensors: dict[str, TensorSpec]
    itemsizes: dict[str, int]
    value_writers: dict[str, int]
    per_rank_keys: tuple[str, ...]
    aliases: dict[str, str]
    world_size: int
    names: tuple[str, ...]
    box_keys: np.ndarray
    box_coords: np.ndarray
    box_writers: np.ndarray
    _layouts: dict[int, tuple[WriteItem, ...]] = field(default_factory=dict, compare=False)
    _by_rank: list[np.ndarray] = field(default_factory=list, compare=False)

    @property
    def chunks(self) -> int:
        """How many boxes are written, by all ranks together."""
        return len(self.box_writers)

    def writes(self, rank: int) -> tuple[WriteItem, ...]:
        """The items ``rank`` writes, laid out in its file (sorted by key, then offsets)."""
        laid = self._layouts.get(rank)
        if laid is None:
            laid = _layout_file(self.assigned(rank), self.itemsizes)
            self._layouts[rank] = laid
        return laid

    def group_by_rank(self) -> None:
        """Sort the boxes by writer once, for a caller that asks for every rank's writes."""
        order = np.argsort(self.box_writers, kind="stable")
        ends = np.searchsorted(self.box_writers[order], np.arange(self.world_size + 1))
        self._by_rank[:] = [order[a:b] for a, b in itertools.pairwise(ends.tolist())]

    def values_of(self, rank: int) -> list[str]:
        """The plain values ``rank`` sends at the commit."""
        return [k for k, r in self.value_writers.items() if r == rank]

    def file_bytes(self, rank: int) -> int:
        return sum(b.numel * self.itemsizes[k] for k, b in self.assigned(rank))

    def assigned(self, rank: int) -> list[tuple[str, Box]]:
        """The (key, box) pairs ``rank`` writes, in no particular order."""
        mine = self._by_rank[rank] if self._by_rank else np.flatnonzero(self.box_writers == rank)
        out = []
        for k, row in zip(self.box_keys[mine].tolist(), self.box_coords[mine]):
            name = self.names[k]
            out.append((name, box_of(row, len(self.tensors[name][1]))))
        return out


TensorSpec = tuple[str, tuple[int, ...], str]
"""(dtype, global shape, layout) of a tensor."""


def build_global_plan(plans: Sequence[LocalPlan | PackedPlan]) -> GlobalPlan:
    """Check agreement, dedup replicas, balance writers, lay out files. Same result everywhere.

    Ranks may hold different keys (pipeline stages, experts, per-rank loader states): a key is
    written by the ranks that hold it. Ranks holding the same key must agree on what it is.
    Work per box is done on arrays; Python work is per tensor, per distinct table of tensors
    and per distinct split pattern (:mod:`.patterns`).
    """
    packed = [p.packed() if isinstance(p, LocalPlan) else p for p in plans]
    keys = _collect_tensors(packed)
    others = _others(packed)
    value_writers, per_rank_keys = _collect_values(others, keys)
    aliases = _collect_aliases(others, keys.tensors, value_writers, per_rank_keys)
    sizes = {k: itemsize(dtype_from_name(d)) for k, (d, _, _) in keys.tensors.items()}
    boxes = _distinct_boxes(packed, keys)
    _balance(boxes, keys, sizes, len(packed))
    return GlobalPlan(
        keys.tensors,
        sizes,
        value_writers,
        per_rank_keys,
        aliases,
        len(packed),
        tuple(keys.tensors),
        boxes.keys,
        boxes.coords,
        boxes.writers,
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
    """Every tensor of any rank (in the order first met) with its first holder, and for each
    rank the index of each of its table's entries."""

    tensors: dict[str, TensorSpec] = field(default_factory=dict)
    first: dict[str, int] = field(default_factory=dict)
    of_rank: list[np.ndarray] = field(default_factory=list)


def _collect_tensors(plans: list[PackedPlan]) -> _Keys:
    """Every tensor of any rank, checked against its first holder. Equal tables of tensors
    (ranks split alike) are read once."""
    keys = _Keys()
    index: dict[str, int] = {}
    seen: dict[bytes, np.ndarray] = {}
    last: tuple[bytes, np.ndarray] | None = None
    for rank, plan in enumerate(plans):
        # The table of the rank before, compared without hashing it, is the common case.
        ids = last[1] if last is not None and plan.table == last[0] else seen.get(plan.table)
        if ids is None:
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
            ids = seen[plan.table] = np.array(found, dtype=np.int64)
        last = (plan.table, ids)
        keys.of_rank.append(ids)
    return keys


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


_Held = np.ndarray | list[np.ndarray]


@dataclass
class _Boxes:
    """The distinct boxes of every tensor: key index, packed coordinates, writer (-1 until
    decided), and for the boxes of several holders, those holders by key index."""

    keys: np.ndarray
    coords: np.ndarray
    writers: np.ndarray
    shared: dict[int, tuple[np.ndarray, _Held]]


def _rows_by_tensor(
    plans: list[PackedPlan], keys: _Keys
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Every rank's rows grouped by tensor: (coords, ranks, bounds), tensor ``k``'s rows at
    ``bounds[k]:bounds[k + 1]``.

    Ranks that split alike (one table, as many boxes per tensor) are stacked tensor-major in one
    pass; otherwise the rows are sorted by tensor (stably, so in rank order; by radix for keys
    of 16 bits).
    """
    world, dims = len(plans), max((p.dims for p in plans), default=0)
    first = plans[0]
    if all(_alike(p, first) for p in plans):
        stacked = np.stack([p.coords for p in plans], axis=1)  # box of the table, rank, coords
        ends = np.cumsum(first.counts).tolist()
        bounds = [0] + [world * e for e in ends]
        ranks = np.concatenate(
            [np.tile(np.arange(world, dtype=np.int32), c) for c in first.counts.tolist()]
            or [np.zeros(0, dtype=np.int32)]
        )
        return stacked.reshape(len(ranks), 2 * dims), ranks, bounds
    row_keys = np.concatenate(
        [np.repeat(ids, p.counts) for ids, p in zip(keys.of_rank, plans)] or [np.zeros(0, int)]
    )
    row_ranks = np.repeat(np.arange(world, dtype=np.int32), [len(p.coords) for p in plans])
    coords = np.concatenate(
        [widen(p.coords, dims) for p in plans] or [np.zeros((0, 2 * dims), dtype=np.int64)]
    )
    narrow = np.uint16 if len(keys.tensors) < (1 << 16) else np.int64
    order = np.argsort(row_keys.astype(narrow), kind="stable")
    bounds = np.searchsorted(row_keys[order], np.arange(len(keys.tensors) + 1)).tolist()
    return coords[order], row_ranks[order], bounds


def _alike(plan: PackedPlan, other: PackedPlan) -> bool:
    """Whether two ranks hold the same tensors with as many boxes each, packed alike."""
    return (
        plan.coords.shape == other.coords.shape
        and plan.coords.dtype == other.coords.dtype
        and plan.table == other.table
        and np.array_equal(plan.counts, other.counts)
    )


def _distinct_boxes(plans: list[PackedPlan], keys: _Keys) -> _Boxes:
    """Every rank's boxes grouped by tensor, deduplicated, checked to tile their tensor."""
    coords, row_ranks, bounds = _rows_by_tensor(plans, keys)
    picked: dict[int, np.ndarray] = {}  # the distinct rows of tensors with replicas
    writers = row_ranks
    shared: dict[int, tuple[np.ndarray, _Held]] = {}
    for k, (key, (_, shape, _)) in enumerate(keys.tensors.items()):
        lo, hi = bounds[k], bounds[k + 1]
        rows, ranks = coords[lo:hi], row_ranks[lo:hi]
        pattern = pattern_of(shape, rows)
        if pattern.fault is not None:
            _refuse(key, shape, pattern.fault, rows, ranks)
        if not pattern.replicated:
            continue
        picked[k] = pattern.first
        shared[k] = _holders(pattern, ranks)
    counts: np.ndarray = np.diff(np.array(bounds, dtype=np.int64))
    if picked:  # keep the distinct rows only; number the shared boxes as kept
        keep = [
            np.arange(lo, hi) if k not in picked else lo + picked[k]
            for k, (lo, hi) in enumerate(itertools.pairwise(bounds))
        ]
        counts = np.array([len(x) for x in keep], dtype=np.int64)
        index = np.concatenate(keep or [np.zeros(0, dtype=np.int64)])
        coords, writers = coords[index], row_ranks[index].copy()
        before = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        shared = {k: (where + before[k], held) for k, (where, held) in shared.items()}
        for where, _ in shared.values():
            writers[where] = -1
    box_keys = np.repeat(np.arange(len(keys.tensors), dtype=np.int32), counts)
    return _Boxes(box_keys, coords, writers, shared)


def _holders(pattern: Pattern, ranks: np.ndarray) -> tuple[np.ndarray, _Held]:
    """The distinct boxes of several holders, and those holders (ascending): one row each of a
    matrix where every box has as many distinct holders (replica groups), else a list."""
    several = np.flatnonzero(pattern.counts > 1)
    grouped = ranks[np.argsort(pattern.inverse, kind="stable")]
    ends = np.cumsum(pattern.counts)
    starts = ends - pattern.counts
    width = pattern.counts[several]
    if (width == width[0]).all():
        matrix = np.sort(grouped[starts[several][:, None] + np.arange(width[0])], axis=1)
        if (matrix[:, 1:] != matrix[:, :-1]).all():
            return several, matrix
    return several, [distinct(grouped[starts[j] : ends[j]]) for j in several.tolist()]


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


def _balance(boxes: _Boxes, keys: _Keys, sizes: dict[str, int], world: int) -> None:
    """Decide the writer of each box held by several ranks: the least-loaded of its holders
    (then the lowest rank), tensors with the largest such boxes first. The boxes of one tensor
    whose holders are disjoint (replica groups) are decided at once; others one by one,
    largest first."""
    if not boxes.shared:
        return
    names = list(keys.tensors)
    nbytes = _numel(boxes.coords) * np.array([sizes[n] for n in names], dtype=np.int64)[boxes.keys]
    single = boxes.writers >= 0
    load = np.bincount(boxes.writers[single], weights=nbytes[single], minlength=world)
    load = load.astype(np.int64)

    def largest(k: int) -> tuple[int, str]:
        return (-int(nbytes[boxes.shared[k][0]].max()), names[k])

    for k in sorted(boxes.shared, key=largest):
        where, holders = boxes.shared[k]
        if isinstance(holders, np.ndarray) and np.bincount(holders.ravel()).max() == 1:
            # disjoint holders: decide them at once
            pick = holders[np.arange(len(holders)), np.argmin(load[holders], axis=1)]
            boxes.writers[where] = pick
            np.add.at(load, pick, nbytes[where])
            continue
        coords = boxes.coords[where]
        for j in sorted(range(len(where)), key=lambda j: (-nbytes[where[j]], coords[j].tolist())):
            rank = min(holders[j].tolist(), key=lambda r: (load[r], r))
            boxes.writers[where[j]] = rank
            load[rank] += nbytes[where[j]]


def _numel(coords: np.ndarray) -> np.ndarray:
    dims = coords.shape[1] // 2
    return np.prod(coords[:, dims:], axis=1, dtype=np.int64)


def _layout_file(items: list[tuple[str, Box]], sizes: dict[str, int]) -> tuple[WriteItem, ...]:
    offset = 0
    laid = []
    for key, box in sorted(items, key=lambda kb: (kb[0], kb[1].offsets)):
        nbytes = math.prod(box.lengths) * sizes[key]
        offset = -(-offset // CHUNK_ALIGN) * CHUNK_ALIGN
        laid.append(WriteItem(key, box, offset, nbytes))
        offset += nbytes
    return tuple(laid)


def rank_loads(plan: GlobalPlan) -> list[int]:
    """Bytes each rank writes under ``plan``."""
    sizes = np.array([plan.itemsizes[n] for n in plan.names], dtype=np.int64)
    nbytes = _numel(plan.box_coords) * sizes[plan.box_keys]
    return np.bincount(plan.box_writers, weights=nbytes, minlength=plan.world_size).tolist()


__all__ = [
    "GlobalPlan",
    "LocalPlan",
    "TensorDecl",
    "WriteItem",
    "build_global_plan",
    "rank_loads",
]
