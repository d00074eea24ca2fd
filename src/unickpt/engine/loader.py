"""A load, step by step: read metadata, match the state against it, read, place, finalize."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..config import Config
from ..dist import Comm, run_step
from ..errors import CheckpointCorruptError, CheckpointMismatchError, UnsafeObjectError
from ..format.dtypes import dtype_name
from ..format.metadata import Metadata
from ..format.values import decode_value
from ..planning.exchange_plan import RankNeeds, plan_exchange
from ..planning.flatten import Flattened, flatten_state
from ..planning.load_plan import ChunkIndex, ReadItem, plan_reads, uncovered_elements
from ..storage.base import Storage
from .commit import read_checkpoint
from .exchange import ExchangeStats, rank_needs, run_exchange
from .read import aligned_piece_bytes, execute_reads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    """Figures of one finished load on this rank."""

    bytes_read: int
    bytes_wanted: int
    skipped_keys: tuple[str, ...]
    bytes_from_peers: int = 0


@dataclass
class _Plan:
    meta: Metadata
    flat: Flattened
    reads: list[ReadItem]
    skipped: tuple[str, ...]
    needed: list[ReadItem]


def load(
    comm: Comm,
    storage: Storage,
    state: dict[str, Any],
    strict: bool,
    allow_pickle: bool,
    config: Config,
) -> LoadReport:
    def prepare() -> tuple[_Plan, RankNeeds | None]:
        _, meta = read_checkpoint(storage)
        if meta.pickled_keys and not allow_pickle:
            raise UnsafeObjectError(
                f"{storage.location} holds pickled objects ({', '.join(meta.pickled_keys[:5])}); "
                "loading them could run code from the checkpoint. Pass allow_pickle=True only "
                "if you trust where it comes from."
            )
        flat = flatten_state(state, for_load=True)
        skipped = _check_keys(meta, flat, strict, comm)
        reads = _plan_all_reads(meta, flat)
        _check_files(storage, meta, reads)
        needs: RankNeeds | None = None
        needed: list[ReadItem] = []
        if comm.world_size > 1 and config.share_reads:
            needs, needed = rank_needs(
                storage, reads, config.verify, meta.segment_bytes, comm.world_size
            )
        return _Plan(meta, flat, reads, skipped, needed), needs

    plan, offers = run_step(comm, "planning the load", prepare)

    def place() -> tuple[LoadReport | None, None]:
        with torch.no_grad():
            shared = _exchange(comm, storage, plan, offers, config)
            if shared is None:
                return None, None  # another rank failed; the step raises its error
            stats = execute_reads(
                storage, shared.local, config, config.verify, plan.meta.segment_bytes
            )
        _set_values(plan, comm, strict, allow_pickle)
        for adapter, template in sorted(plan.flat.stateful, key=lambda a: a[0].order):
            adapter.load_state_dict(template)
        x = shared.stats
        return LoadReport(
            stats.bytes_read + x.bytes_read,
            stats.bytes_wanted + x.bytes_wanted,
            plan.skipped,
            x.bytes_from_peers,
        ), None

    report, _ = run_step(comm, "loading", place)
    assert report is not None
    return report


@dataclass(frozen=True)
class _Shared:
    """The exchange's figures, and the read items left for this rank to read on its own."""

    stats: ExchangeStats
    local: list[ReadItem]


def _exchange(
    comm: Comm,
    storage: Storage,
    plan: _Plan,
    offers: list[RankNeeds | None],
    config: Config,
) -> _Shared | None:
    """Read the chunks that ranks of one host share once, and return what is left to read."""
    none = _Shared(ExchangeStats(0, 0, 0), plan.reads)
    if not any(o is not None and o.needs for o in offers):
        return none
    seg = plan.meta.segment_bytes
    unit = aligned_piece_bytes(config.read_piece_bytes // 16, seg)
    xplan = plan_exchange(
        offers, plan.meta.tensors, plan.meta.files, seg, unit, unit * config.io_threads
    )
    if not xplan.units:
        return none
    stats = run_exchange(comm, storage, xplan, plan.needed, config, config.verify, seg)
    if stats is None:
        return None
    if not stats.shared:
        return _Shared(stats, plan.reads)
    done = {id(plan.needed[i]) for i in xplan.exchanged(comm.rank)}
    return _Shared(stats, [r for r in plan.reads if id(r) not in done])


def _few(keys: list[str], n: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _check_keys(meta: Metadata, flat: Flattened, strict: bool, comm: Comm) -> tuple[str, ...]:
    saved = set(meta.tensors) | set(meta.objects) | set(meta.per_rank)
    wanted = flat.keys()
    missing = sorted(wanted - saved)
    tops = {k.split(".", 1)[0] for k in wanted}
    unexpected = sorted(k for k in saved - wanted if k.split(".", 1)[0] in tops)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"the state has keys the checkpoint lacks: {_few(missing)}")
        if unexpected:
            parts.append(f"the checkpoint has keys the state lacks: {_few(unexpected)}")
        raise CheckpointMismatchError(
            "; ".join(parts) + ". Pass strict=False to load the keys both have (the others keep "
            "their current values), or load into a state with the saved structure."
        )
    if missing:
        warnings.warn(
            f"strict=False: {len(missing)} keys are not in the checkpoint and keep their "
            f"current values: {_few(missing)}",
            stacklevel=4,
        )
    for key, leaf in flat.tensors.items():
        if key not in saved:
            continue
        if key not in meta.tensors:
            raise CheckpointMismatchError(
                f"'{key}' is a tensor in the state but a plain value in the checkpoint; load "
                "it into a non-tensor slot, or check that this is the right checkpoint."
            )
        saved_t = meta.tensors[key]
        if tuple(saved_t.shape) != leaf.shape:
            raise CheckpointMismatchError(
                f"'{key}' has global shape {list(saved_t.shape)} in the checkpoint but "
                f"{list(leaf.shape)} in the state; build the model with the saved "
                "configuration (unickpt reshards layouts, not sizes)."
            )
        if saved_t.dtype != dtype_name(leaf.dtype):
            raise CheckpointMismatchError(
                f"'{key}' is {saved_t.dtype} in the checkpoint but {dtype_name(leaf.dtype)} in the "
                f"state; create the state with dtype {saved_t.dtype} (and cast after loading if "
                "needed)."
            )
    if flat.per_rank and meta.world_size != comm.world_size and strict:
        raise CheckpointMismatchError(
            f"per-rank values ({_few(sorted(flat.per_rank))}) were saved by "
            f"{meta.world_size} ranks but {comm.world_size} ranks are loading; pass strict=False "
            "to restore rank r's value on rank r where it exists and keep current values "
            "elsewhere."
        )
    return tuple(missing)


def _plan_all_reads(meta: Metadata, flat: Flattened) -> list[ReadItem]:
    reads: list[ReadItem] = []
    for key, leaf in flat.tensors.items():
        saved = meta.tensors.get(key)
        if saved is None or not leaf.pieces:
            continue
        items = plan_reads(key, saved, meta.files, leaf.pieces, ChunkIndex(saved.chunks))
        if uncovered_elements(leaf.pieces, items) != 0:
            raise CheckpointCorruptError(
                f"the saved chunks of '{key}' do not cover the part this rank needs; the "
                "metadata is damaged. Load an earlier checkpoint."
            )
        reads.extend(items)
    return reads


def _check_files(storage: Storage, meta: Metadata, reads: list[ReadItem]) -> None:
    ends: dict[str, int] = {}
    for r in reads:
        ends[r.file] = max(ends.get(r.file, 0), r.chunk.byte_offset + r.chunk.nbytes)
    for name, end in ends.items():
        size = storage.size(name)
        if size is None:
            raise CheckpointCorruptError(
                f"{storage.location}/{name} is missing, but the checkpoint's metadata names it; "
                "the checkpoint is incomplete. Load an earlier checkpoint."
            )
        if size < end:
            raise CheckpointCorruptError(
                f"{storage.location}/{name} has {size} bytes but the metadata places data up to "
                f"byte {end}; the file is truncated. Load an earlier checkpoint."
            )


def _set_values(plan: _Plan, comm: Comm, strict: bool, allow_pickle: bool) -> None:
    meta = plan.meta
    for key, leaf in plan.flat.values.items():
        if key in meta.objects and leaf.setter is not None:
            leaf.setter(decode_value(meta.objects[key], key, allow_pickle))
        elif key in meta.tensors:
            raise CheckpointMismatchError(
                f"'{key}' is a tensor in the checkpoint but a {type(leaf.value).__name__} in "
                "the state; put a tensor of the saved shape there to load it."
            )
    for key, holder in plan.flat.per_rank.items():
        values = meta.per_rank.get(key)
        if values is None:
            continue
        if comm.rank < len(values):
            holder.value = decode_value(values[comm.rank], key, allow_pickle)
            if len(values) != comm.world_size:
                log.warning("'%s': restored the value saved by rank %d", key, comm.rank)
        else:
            warnings.warn(
                f"'{key}' was saved by {len(values)} ranks; rank {comm.rank} has no saved value "
                "and keeps its current one.",
                stacklevel=2,
            )
