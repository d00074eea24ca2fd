"""The save plan: replicas written once, the writing balanced across ranks.

Every rank describes what it holds (:class:`LocalPlan`); :func:`build_global_plan`, a pure
function run identically on every rank, checks that ranks holding the same key agree and that
the distinct boxes of each tensor tile it exactly, gives each distinct box to the least-loaded
rank holding it (largest first), each plain value to the lowest rank holding it, and lays out
each rank's data file.
"""

from __future__ import annotations

import array
import hashlib
import math
from dataclasses import dataclass, field

from ..errors import CheckpointMismatchError
from ..format.dtypes import dtype_from_name, itemsize
from ..layouts.boxes import Box
from ..layouts.coverage import cached_tiling_fault

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

    def signature(self) -> str:
        """A digest of the structure; equal digests mean an unchanged plan."""
        h = hashlib.blake2b(digest_size=16)
        for key in sorted(self.tensors):
            t = self.tensors[key]
            h.update(repr((key, t.dtype, t.shape, t.layout, t.boxes)).encode())
        h.update(repr((self.value_keys, self.per_rank_keys, sorted(self.aliases.items()))).encode())
        return h.hexdigest()


@dataclass(frozen=True)
class WriteItem:
    """One box a rank writes, at ``byte_offset`` of its data file."""

    key: str
    box: Box
    byte_offset: int
    nbytes: int


@dataclass(frozen=True)
class GlobalPlan:
    """Who writes what. Each rank's file layout is computed when that rank asks for it.

    ``written_keys[r]`` and ``written_boxes[r]`` (parallel) are the boxes rank ``r`` writes.
    ``value_writers`` names, per plain value, the rank that sends it at the commit (the lowest
    rank holding it); ``per_rank_keys`` are those of any rank.
    """

    tensors: dict[str, TensorSpec]
    written_keys: tuple[tuple[str, ...], ...]
    written_boxes: tuple[tuple[Box, ...], ...]
    itemsizes: dict[str, int]
    value_writers: dict[str, int]
    per_rank_keys: tuple[str, ...]
    aliases: dict[str, str] = field(default_factory=dict)
    _layouts: dict[int, tuple[WriteItem, ...]] = field(default_factory=dict, compare=False)

    @property
    def world_size(self) -> int:
        return len(self.written_keys)

    def writes(self, rank: int) -> tuple[WriteItem, ...]:
        """The items ``rank`` writes, laid out in its file (sorted by key, then offsets)."""
        laid = self._layouts.get(rank)
        if laid is None:
            laid = _layout_file(self.assigned(rank), self.itemsizes)
            self._layouts[rank] = laid
        return laid

    def values_of(self, rank: int) -> list[str]:
        """The plain values ``rank`` sends at the commit."""
        return [k for k, r in self.value_writers.items() if r == rank]

    def file_bytes(self, rank: int) -> int:
        return sum(b.numel * self.itemsizes[k] for k, b in self.assigned(rank))

    def assigned(self, rank: int) -> list[tuple[str, Box]]:
        """The (key, box) pairs ``rank`` writes, in no particular order."""
        return list(zip(self.written_keys[rank], self.written_boxes[rank]))


TensorSpec = tuple[str, tuple[int, ...], str]
"""(dtype, global shape, layout) of a tensor."""


@dataclass
class Holders:
    """The distinct boxes of one tensor, each with the rank holding it (an int) or the ranks
    holding it (a list, for replicas); ``coords``: the offsets and lengths of each distinct box
    in the order first seen, packed (the key under which its tiling check is remembered)."""

    ranks: dict[Box, int | list[int]] = field(default_factory=dict)
    coords: array.array = field(default_factory=lambda: array.array("q"))

    def of(self, box: Box) -> list[int]:
        held = self.ranks[box]
        return [held] if isinstance(held, int) else held


def build_global_plan(plans: list[LocalPlan]) -> GlobalPlan:
    """Check agreement, dedup replicas, balance writers, lay out files. Same result everywhere.

    Ranks may hold different keys (pipeline stages, experts, per-rank loader states): a key is
    written by the ranks that hold it. Ranks holding the same key must agree on what it is.
    """
    tensors, holders = _collect_tensors(plans)
    value_writers, per_rank_keys = _collect_values(plans, tensors)
    aliases = _collect_aliases(plans, tensors, value_writers, per_rank_keys)
    _check_tiling(tensors, holders)
    sizes = {k: itemsize(dtype_from_name(d)) for k, (d, _, _) in tensors.items()}
    keys, boxes = _balance(holders, sizes, len(plans))
    return GlobalPlan(
        tensors,
        tuple(map(tuple, keys)),
        tuple(map(tuple, boxes)),
        sizes,
        value_writers,
        per_rank_keys,
        aliases,
    )


_KINDS = {
    "replicated": "a plain tensor",
    "dtensor": "a DTensor",
    "sharded": "a ShardedTensor block",
    "flat": "a FlatShard range",
}


def _describe(dtype: str, shape: tuple[int, ...], layout: str) -> str:
    return f"{_KINDS.get(layout, layout)} {dtype}{list(shape)}"


def _collect_tensors(plans: list[LocalPlan]) -> tuple[dict[str, TensorSpec], dict[str, Holders]]:
    """Every tensor of any rank, checked against its first holder; the holders of each box.

    The loop runs once per box of every rank (millions at scale): it allocates nothing per box
    but a dict slot, and packs each new box's coordinates while the box is in cache.
    """
    tensors: dict[str, TensorSpec] = {}
    first: dict[str, int] = {}
    holders: dict[str, Holders] = {}
    for rank, plan in enumerate(plans):
        for key, decl in plan.tensors.items():
            spec = (decl.dtype, decl.shape, decl.layout)
            known = tensors.get(key)
            if known is None:
                tensors[key] = spec
                first[key] = rank
                entry = holders[key] = Holders()
            elif known != spec:
                raise CheckpointMismatchError(
                    f"'{key}' is {_describe(*spec)} on rank {rank} but {_describe(*known)} on "
                    f"rank {first[key]}; ranks holding the same key must describe the same "
                    "global tensor (same kind, dtype and global shape). Rename one of them if "
                    "they are different tensors."
                )
            else:
                entry = holders[key]
            hold, coords = entry.ranks.setdefault, entry.coords
            for box in decl.boxes:
                held = hold(box, rank)
                if held is rank:
                    coords.extend(box.offsets)
                    coords.extend(box.lengths)
                elif isinstance(held, int):
                    entry.ranks[box] = [held, rank]
                else:
                    held.append(rank)
    return tensors, holders


def _collect_values(
    plans: list[LocalPlan], tensors: dict[str, TensorSpec]
) -> tuple[dict[str, int], tuple[str, ...]]:
    """The lowest rank holding each plain value, and every per-rank key; kinds must agree."""
    writers: dict[str, int] = {}
    per_rank: dict[str, int] = {}
    for rank, plan in enumerate(plans):
        for key in plan.value_keys:
            writers.setdefault(key, rank)
        for key in plan.per_rank_keys:
            per_rank.setdefault(key, rank)
    for key, rank in writers.items():
        if key in tensors:
            _kind_clash(key, "a plain value", rank, "a tensor", _first_tensor_rank(plans, key))
        if key in per_rank:
            _kind_clash(key, "a plain value", rank, "a unickpt.PerRank value", per_rank[key])
    for key, rank in per_rank.items():
        if key in tensors:
            _kind_clash(key, "a PerRank value", rank, "a tensor", _first_tensor_rank(plans, key))
    return writers, tuple(sorted(per_rank))


def _first_tensor_rank(plans: list[LocalPlan], key: str) -> int:
    return next(r for r, p in enumerate(plans) if key in p.tensors)


def _kind_clash(key: str, kind: str, rank: int, other: str, other_rank: int) -> None:
    raise CheckpointMismatchError(
        f"'{key}' is {kind} on rank {rank} but {other} on rank {other_rank}; a key must be the "
        "same kind of leaf on every rank that holds it. Rename one of them."
    )


def _collect_aliases(
    plans: list[LocalPlan],
    tensors: dict[str, TensorSpec],
    values: dict[str, int],
    per_rank: tuple[str, ...],
) -> dict[str, str]:
    """Tied keys of every rank: each names the same first key everywhere, and is no leaf."""
    aliases: dict[str, str] = {}
    origin: dict[str, int] = {}
    others = set(values) | set(per_rank)
    for rank, plan in enumerate(plans):
        for key, target in plan.aliases.items():
            known = aliases.setdefault(key, target)
            origin.setdefault(key, rank)
            if known != target:
                raise CheckpointMismatchError(
                    f"'{key}' is tied to '{target}' on rank {rank} but to '{known}' on rank "
                    f"{origin[key]}; tie the same weights on every rank."
                )
            if key in tensors or key in others:
                raise CheckpointMismatchError(
                    f"'{key}' is tied to '{target}' on rank {rank} (one tensor under two keys) "
                    "but is a separate leaf on another rank; tie the same weights on every rank."
                )
    return aliases


def _check_tiling(tensors: dict[str, TensorSpec], holders: dict[str, Holders]) -> None:
    """The distinct boxes of each tensor hold every element exactly once."""
    for key, entry in holders.items():
        shape = tensors[key][1]
        fault = cached_tiling_fault(shape, list(entry.ranks), entry.coords.tobytes())
        if fault is None:
            continue
        held = sorted({r for b in entry.ranks if b.intersect(fault.region) for r in entry.of(b)})
        shown = ", ".join(str(r) for r in held[:8]) + (" ..." if len(held) > 8 else "")
        whose = f" (shards of ranks {shown})" if held else ""
        raise CheckpointMismatchError(
            f"the shards of '{key}' (global shape {list(shape)}) do not tile it: "
            f"{fault.describe()}{whose}. Check the offsets and global shapes passed on each "
            "rank: the distinct shards (replicas count once) must cover the tensor without gaps "
            "or overlaps."
        )


def _balance(
    holders: dict[str, Holders], sizes: dict[str, int], world: int
) -> tuple[list[list[str]], list[list[Box]]]:
    """The keys and boxes each rank writes: a box held by one rank goes to it, replicas to the
    least-loaded of their holders, largest first. (Parallel lists rather than pairs: at scale,
    millions of pairs would cost more in allocation and garbage collection than the rest.)"""
    keys: list[list[str]] = [[] for _ in range(world)]
    boxes: list[list[Box]] = [[] for _ in range(world)]
    shared: list[tuple[str, Box, list[int]]] = []
    for key, entry in holders.items():
        for box, held in entry.ranks.items():
            if isinstance(held, int):
                keys[held].append(key)
                boxes[held].append(box)
            else:
                shared.append((key, box, held))
    if not shared:
        return keys, boxes
    load = [sum(b.numel * sizes[k] for k, b in zip(keys[r], boxes[r])) for r in range(world)]
    shared.sort(key=lambda kbr: (-kbr[1].numel * sizes[kbr[0]], kbr[0], kbr[1].offsets))
    for key, box, ranks in shared:
        rank = min(ranks, key=lambda r: (load[r], r))
        load[rank] += box.numel * sizes[key]
        keys[rank].append(key)
        boxes[rank].append(box)
    return keys, boxes


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
    return [plan.file_bytes(r) for r in range(plan.world_size)]


__all__ = [
    "GlobalPlan",
    "LocalPlan",
    "TensorDecl",
    "WriteItem",
    "build_global_plan",
    "rank_loads",
]
