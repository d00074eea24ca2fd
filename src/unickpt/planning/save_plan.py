"""The save plan: replicas written once, the writing balanced across ranks.

Every rank describes what it holds (:class:`LocalPlan`); :func:`build_global_plan`, a pure
function run identically on every rank, checks that the ranks agree, gives each distinct box
to the least-loaded rank holding it (largest first) and lays out each rank's data file.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass, field

from ..errors import CheckpointMismatchError
from ..format.dtypes import dtype_from_name, itemsize
from ..layouts.boxes import Box

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
    """One rank's view of the state's structure."""

    tensors: dict[str, TensorDecl]
    value_keys: tuple[str, ...]
    per_rank_keys: tuple[str, ...]

    def signature(self) -> str:
        """A digest of the structure; equal digests mean an unchanged plan."""
        h = hashlib.blake2b(digest_size=16)
        for key in sorted(self.tensors):
            t = self.tensors[key]
            h.update(repr((key, t.dtype, t.shape, t.layout, t.boxes)).encode())
        h.update(repr((self.value_keys, self.per_rank_keys)).encode())
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
    """Who writes what. Each rank's file layout is computed when that rank asks for it."""

    tensors: dict[str, tuple[str, tuple[int, ...], str]]
    assigned: tuple[tuple[tuple[str, Box], ...], ...]
    itemsizes: dict[str, int]
    value_keys: tuple[str, ...]
    per_rank_keys: tuple[str, ...]
    _layouts: dict[int, tuple[WriteItem, ...]] = field(default_factory=dict, compare=False)

    @property
    def world_size(self) -> int:
        return len(self.assigned)

    def writes(self, rank: int) -> tuple[WriteItem, ...]:
        """The items ``rank`` writes, laid out in its file (sorted by key, then offsets)."""
        laid = self._layouts.get(rank)
        if laid is None:
            laid = _layout_file(self.assigned[rank], self.itemsizes)
            self._layouts[rank] = laid
        return laid

    def file_bytes(self, rank: int) -> int:
        return sum(math.prod(b.lengths) * self.itemsizes[k] for k, b in self.assigned[rank])


def build_global_plan(plans: list[LocalPlan]) -> GlobalPlan:
    """Check agreement, dedup replicas, balance writers, lay out files. Same result everywhere."""
    _check_same_keys(plans)
    tensors = _check_same_tensors(plans)
    holders: dict[tuple[str, Box], list[int]] = {}
    for rank, plan in enumerate(plans):
        for key, decl in plan.tensors.items():
            for box in decl.boxes:
                found = holders.get((key, box))
                if found is None:
                    holders[(key, box)] = [rank]
                else:
                    found.append(rank)
    _check_coverage(tensors, holders)
    sizes = {k: itemsize(dtype_from_name(d)) for k, (d, _, _) in tensors.items()}
    assigned = _balance(holders, sizes, len(plans))
    return GlobalPlan(
        tensors,
        tuple(tuple(a) for a in assigned),
        sizes,
        plans[0].value_keys,
        plans[0].per_rank_keys,
    )


def _balance(
    holders: dict[tuple[str, Box], list[int]], sizes: dict[str, int], world: int
) -> list[list[tuple[str, Box]]]:
    """Single-holder boxes go to their holder; replicas to the least-loaded, largest first."""
    load = [0] * world
    out: list[list[tuple[str, Box]]] = [[] for _ in range(world)]
    shared = []
    for kb, ranks in holders.items():
        if len(ranks) == 1:
            out[ranks[0]].append(kb)
        else:
            shared.append(kb)
    if shared:
        for rank, items in enumerate(out):
            load[rank] = sum(math.prod(b.lengths) * sizes[k] for k, b in items)
    shared.sort(key=lambda kb: (-kb[1].numel * sizes[kb[0]], kb[0], kb[1].offsets))
    for key, box in shared:
        rank = min(holders[(key, box)], key=lambda r: (load[r], r))
        load[rank] += box.numel * sizes[key]
        out[rank].append((key, box))
    return out


def _layout_file(
    items: tuple[tuple[str, Box], ...], sizes: dict[str, int]
) -> tuple[WriteItem, ...]:
    offset = 0
    laid = []
    for key, box in sorted(items, key=lambda kb: (kb[0], kb[1].offsets)):
        nbytes = math.prod(box.lengths) * sizes[key]
        offset = -(-offset // CHUNK_ALIGN) * CHUNK_ALIGN
        laid.append(WriteItem(key, box, offset, nbytes))
        offset += nbytes
    return tuple(laid)


def _check_same_keys(plans: list[LocalPlan]) -> None:
    per_rank = [
        set(p.tensors) | set(p.value_keys) | {f"{k} (per-rank)" for k in p.per_rank_keys}
        for p in plans
    ]
    union = set().union(*per_rank)
    problems = []
    for rank, keys in enumerate(per_rank):
        missing = sorted(union - keys)
        if missing:
            problems.append(f"rank {rank} lacks {_few(missing)}")
    if problems:
        raise CheckpointMismatchError(
            "the ranks' states have different keys: " + "; ".join(problems) + ". Every rank must "
            "pass the same structure (wrap values that exist on some ranks only in "
            "unickpt.PerRank)."
        )


def _check_same_tensors(plans: list[LocalPlan]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    first = plans[0].tensors
    for rank, plan in enumerate(plans[1:], start=1):
        for key, decl in plan.tensors.items():
            ref = first[key]
            if (decl.dtype, decl.shape, decl.layout) != (ref.dtype, ref.shape, ref.layout):
                raise CheckpointMismatchError(
                    f"'{key}' is {decl.dtype}{list(decl.shape)} ({decl.layout}) on rank {rank} "
                    f"but {ref.dtype}{list(ref.shape)} ({ref.layout}) on rank 0; every rank must "
                    "describe the same global tensor."
                )
    return {k: (d.dtype, d.shape, d.layout) for k, d in first.items()}


def _check_coverage(
    tensors: dict[str, tuple[str, tuple[int, ...], str]],
    holders: dict[tuple[str, Box], list[int]],
) -> None:
    covered: dict[str, int] = defaultdict(int)
    for key, box in holders:
        covered[key] += math.prod(box.lengths)
    for key, (_, shape, _) in tensors.items():
        total = math.prod(shape)
        if covered[key] != total:
            raise CheckpointMismatchError(
                f"the shards of '{key}' (global shape {list(shape)}) cover {covered[key]} "
                f"elements counting each distinct shard once, but the tensor has {total}; check "
                "the offsets and global shapes passed on each rank (shards must tile the tensor "
                "without gaps or overlaps)."
            )


def _few(keys: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")


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
