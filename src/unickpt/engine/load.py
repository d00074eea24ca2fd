"""A load, step by step: read metadata, match the state against it, read, place, finalize."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import Config
from ..dist import Comm, run_step
from ..encoding.reading import DecodeItem, plan_encoded_reads, stored_rows
from ..errors import CheckpointCorruptError, CheckpointMismatchError, UnsafeObjectError
from ..foreign.common import foreign_format
from ..format.metadata import Metadata
from ..format.values import decode_value
from ..layouts.boxes import Box
from ..layouts.leaves import PerRank
from ..planning.exchange_plan import ExchangePlan, RankNeeds, plan_exchange
from ..planning.flatten import Flattened, flatten_state
from ..planning.load_keys import (
    KeyMap,
    KeyMatch,
    SavedKeys,
    StateKeys,
    match_keys,
    not_loaded_warning,
    rename_to_saved,
    unread_message,
)
from ..planning.load_plan import ChunkIndex, ReadItem, plan_reads
from ..planning.node_plan import NodePlan, plan_node_reads
from ..planning.per_rank import missing_warning, needs_reshard, reshard
from ..storage.base import Storage
from .collector import collector_paused
from .commit import read_metadata
from .exchange import ExchangeStats, across_nodes, node_of_reads, rank_needs, run_exchange
from .indexes import SavedChunks
from .mapped import run_mapped_exchange
from .node_exchange import run_node_exchange
from .read_chunks import aligned_piece_bytes, execute_reads

log = logging.getLogger(__name__)
# Reads shared across nodes: units of read_piece_bytes / 8 (a whole chunk of up to 8 MiB moves
# as one message, straight into place), rounds of read_piece_bytes / 2 per rank.
_NODE_UNIT_SHARE = 8
_NODE_ROUND_SHARE = 2


@dataclass(frozen=True)
class LoadReport:
    """Figures of one finished load on this rank.

    ``skipped_keys``: keys of this rank's state that kept their current values (not in the
    checkpoint, or a different kind, shape or dtype there; strict=False only).
    ``unread_keys``: saved keys under the loaded top-level keys that no rank's state asked for
    (strict=False only; a strict load refuses them).
    ``bytes_from_peers``: bytes this rank took from buffers other ranks of its host read.
    ``unverified_files``: files this rank read without checksums to verify (a safetensors
    model or a DCP folder carries none).
    ``bytes_received``: bytes another rank read and sent this rank over the process group
    (ranks of several nodes loading the same bytes; ``bytes_read`` counts them once, at the
    rank that read them).
    """

    bytes_read: int
    bytes_wanted: int
    skipped_keys: tuple[str, ...]
    unread_keys: tuple[str, ...] = ()
    bytes_from_peers: int = 0
    unverified_files: tuple[str, ...] = ()
    bytes_received: int = 0


@dataclass
class _Plan:
    meta: Metadata
    flat: Flattened
    match: KeyMatch
    saved: SavedKeys
    chunks: SavedChunks | None = None
    reads: list[ReadItem] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    needed: list[ReadItem] = field(default_factory=list)
    decodes: list[DecodeItem] = field(default_factory=list)
    sharing: ExchangePlan | None = None
    nodes: NodePlan | None = None


@collector_paused()
def load(
    comm: Comm,
    storage: Storage,
    state: dict[str, Any],
    strict: bool,
    allow_pickle: bool,
    config: Config,
    keys: KeyMap | StateKeys | None = None,
    read_meta: Callable[[Storage], Metadata] | None = None,
) -> LoadReport:
    """Match this rank's state (per rank), find saved keys no rank asks for (across ranks),
    then read and place. Each step raises the same error on every rank when any rank fails.

    ``keys`` renames saved keys to the state's (see :func:`rename_for_load`; a
    :class:`StateKeys` renames the state's keys to the saved ones instead); ``read_meta``
    reads the metadata (default: a unickpt checkpoint's; a foreign format's translation comes
    with every chunk, checked, and no indexes)."""

    def match() -> tuple[_Plan, tuple[str, str | None]]:
        meta = read_meta(storage) if read_meta is not None else read_metadata(storage)[1]
        if meta.pickled_keys and not allow_pickle:
            raise UnsafeObjectError(
                f"{storage.location} holds pickled objects ({', '.join(meta.pickled_keys[:5])}); "
                "loading them could run code from the checkpoint. Pass allow_pickle=True only "
                "if you trust where it comes from."
            )
        flat = flatten_state(state, for_load=True)
        if keys is not None:
            flat = rename_to_saved(flat, meta.keys(), keys)
        found = match_keys(meta, flat, strict)
        _check_per_rank(meta, flat, comm)
        chunks = None if foreign_format(meta) else SavedChunks(storage, meta)
        return _Plan(meta, flat, found, SavedKeys.of(meta), chunks), node_of_reads(storage)

    plan, places = run_step(comm, "planning the load", match)
    asked = comm.max_across(plan.saved.asked(plan.flat, plan.match))

    def prepare() -> tuple[None, RankNeeds | None]:
        plan.unread = plan.saved.unread(asked)
        if strict and plan.unread:
            message = unread_message(plan.meta, plan.unread, plan.flat.numbered, comm.world_size)
            raise CheckpointMismatchError(message)
        if not strict:
            warning = not_loaded_warning(plan.meta, plan.unread, plan.match, comm.world_size)
            if warning is not None:
                warnings.warn(warning, stacklevel=5)
        if plan.chunks is not None:
            plan.meta = plan.chunks.load(_wanted(plan))
        plan.reads = _plan_all_reads(plan)
        _check_files(storage, plan.meta, plan.reads)
        needs: RankNeeds | None = None
        if comm.world_size > 1 and config.share_reads:
            seg = plan.meta.segment_bytes
            across = config.share_across_nodes and across_nodes(places, comm.rank)
            piece = config.read_piece_bytes
            needs, plan.needed = rank_needs(
                storage, plan.reads, config.verify, seg, comm.world_size, across, piece
            )
        return None, needs

    _, offers = run_step(comm, "planning the load", prepare)
    sharing = any(o is not None and o.needs for o in offers)  # the same on every rank
    across = any(o is not None and o.source is not None for o in offers)
    apart = sharing and (across or not storage.maps_files)  # planned in a step of its own
    if apart:
        # The exchanges over the process group and through shared memory run collectives: a
        # rank failing to plan them must fail before any rank enters them. Mapped files share
        # on a host without one, so they alone are planned within the load's own step (one
        # gather fewer); a failure there is gathered at its end.

        def share() -> tuple[None, None]:
            plan.sharing = _plan_sharing(storage, plan, offers, config, comm.rank)
            return None, None

        run_step(comm, "planning the load", share)

    def place() -> tuple[LoadReport | None, None]:
        if sharing and not apart:
            plan.sharing = _plan_sharing(storage, plan, offers, config, comm.rank)
        with torch.no_grad():
            shared = _exchange(comm, storage, plan, config)
            if shared is None:
                return None, None  # another rank failed; the step raises its error
            stats = execute_reads(
                storage, shared.local, config, config.verify, plan.meta.segment_bytes
            )
            for decode in plan.decodes:
                decode.run()
        _set_values(plan, comm, allow_pickle)
        for adapter, template in sorted(plan.flat.stateful, key=lambda a: a[0].order):
            adapter.load_state_dict(template)
        x = shared.stats
        return LoadReport(
            stats.bytes_read + x.bytes_read,
            stats.bytes_wanted + x.bytes_wanted,
            plan.match.skipped,
            tuple(plan.unread),
            x.bytes_from_peers,
            tuple(sorted({r.file for r in plan.reads if not r.chunk.checksums})),
            x.bytes_received,
        ), None

    report, _ = run_step(comm, "loading", place)
    assert report is not None
    return report


@dataclass(frozen=True)
class _Shared:
    """The exchange's figures, and the read items left for this rank to read on its own."""

    stats: ExchangeStats
    local: list[ReadItem]


def _unit_bytes(storage: Storage, config: Config, segment: int) -> int:
    """Mapped units need no buffer of their own beyond one scratch per thread: larger units,
    fewer to plan. Shared-memory units are double-buffered per owner: smaller."""
    share = 4 if storage.maps_files else 16
    return aligned_piece_bytes(config.read_piece_bytes // share, segment)


def _plan_sharing(
    storage: Storage, plan: _Plan, offers: list[RankNeeds | None], config: Config, rank: int
) -> ExchangePlan:
    """The plans of reads shared across nodes (into ``plan.nodes``) and on each host (returned),
    from every rank's needs (the same on every rank; the chunks only other ranks need are
    planned from the geometry their needs carry, so no rank reads another rank's indexes).
    What the plan across nodes serves, the host's does not."""
    seg = plan.meta.segment_bytes
    tensors, files = plan.meta.tensors, plan.meta.files
    served: dict[int, frozenset[int]] = {}
    pieces = [o.piece for o in offers if o is not None and o.source is not None]
    if pieces:  # the largest piece any rank reported: every rank plans with the same
        unit = aligned_piece_bytes(max(pieces) // _NODE_UNIT_SHARE, seg)
        rounds = max(unit, max(pieces) // _NODE_ROUND_SHARE)
        plan.nodes = plan_node_reads(offers, tensors, files, seg, unit, rounds)
        plan.nodes.taken(rank)  # raises here, within a step, should this rank lack a chunk
        served = plan.nodes.served
    unit = _unit_bytes(storage, config, seg)
    planned = plan_exchange(offers, tensors, files, seg, unit, unit * config.io_threads, served)
    planned.taken(rank)  # raises here, within a step, should this rank lack a chunk it needs
    return planned


def _exchange(comm: Comm, storage: Storage, plan: _Plan, config: Config) -> _Shared | None:
    """Read the chunks that ranks of several nodes, then of one host, share once; what is
    left to read alone."""
    seg = plan.meta.segment_bytes
    done: set[int] = set()
    totals = ExchangeStats(0, 0, 0)
    nodes = plan.nodes
    if nodes is not None and nodes.fetches:
        got = run_node_exchange(comm, storage, nodes, plan.needed, config, config.verify, seg)
        if got is None:
            return None
        totals = got
        done = {id(plan.needed[i]) for i in nodes.served.get(comm.rank, ())}
    xplan = plan.sharing
    if xplan is not None and xplan.units:
        if storage.maps_files:
            stats: ExchangeStats | None = run_mapped_exchange(
                comm.rank, storage, xplan, plan.needed, config, config.verify, seg
            )
        else:
            stats = run_exchange(comm, storage, xplan, plan.needed, config, config.verify, seg)
        if stats is None:
            return None
        if stats.shared:
            done |= {id(plan.needed[i]) for i in xplan.exchanged(comm.rank)}
        totals = _sum(totals, stats)
    return _Shared(totals, [r for r in plan.reads if id(r) not in done])


def _sum(a: ExchangeStats, b: ExchangeStats) -> ExchangeStats:
    return ExchangeStats(
        a.bytes_read + b.bytes_read,
        a.bytes_wanted + b.bytes_wanted,
        a.bytes_from_peers + b.bytes_from_peers,
        bytes_received=a.bytes_received + b.bytes_received,
    )


def _check_per_rank(meta: Metadata, flat: Flattened, comm: Comm) -> None:
    """Refuse where a PerRank asks for an error and this rank has no saved value."""
    for key, holder in flat.per_rank.items():
        if key not in meta.per_rank or holder.on_world_change != "error":
            continue
        found, _ = meta.per_rank_value(key, comm.rank)
        if not found or meta.world_size != comm.world_size:
            raise CheckpointMismatchError(
                f"'{key}' is a PerRank value with on_world_change='error'; "
                f"{_per_rank_story(meta, key, comm.world_size)}. Load on the saved world size, "
                "or use on_world_change='warn' to keep the current value where none was saved."
            )


def _per_rank_story(meta: Metadata, key: str, world_size: int) -> str:
    held = [r for r in range(meta.world_size) if meta.per_rank_value(key, r)[0]]
    which = "no rank" if not held else ("rank " if len(held) == 1 else "ranks ") + _span(held)
    return (
        f"it was saved by {meta.world_size} ranks ({which} holding a value) and {world_size} "
        "ranks are loading"
    )


def _span(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


def _wanted(plan: _Plan) -> dict[str, list[Box]]:
    """The boxes of each saved tensor this rank reads, in stored coordinates (an encoded
    table's rows whole); none where the state matched the key but a different shape skips it:
    its chunks are still checked."""
    skipped = set(plan.match.differ)
    wanted: dict[str, list[Box]] = {}
    for key, leaf in plan.flat.tensors.items():
        stored = plan.match.resolved.get(key)
        if stored is not None:
            boxes = wanted.setdefault(stored, [])
            if key not in skipped:
                saved = plan.meta.tensors[stored]
                if saved.encoding is None:
                    boxes.extend(box for box, _ in leaf.pieces)
                else:
                    boxes.extend(stored_rows(saved, box) for box, _ in leaf.pieces)
    return wanted


def _plan_all_reads(plan: _Plan) -> list[ReadItem]:
    """Read items of every tensor this rank loads, from the chunks :class:`SavedChunks` read
    (and checked to tile each tensor the state matched, also where a different shape skips it:
    a forged or damaged shape is then reported as such)."""
    meta, skipped = plan.meta, set(plan.match.differ)
    reads: list[ReadItem] = []
    for key, leaf in plan.flat.tensors.items():
        stored = plan.match.resolved.get(key)
        if stored is None or key in skipped or not leaf.pieces:
            continue
        saved = meta.tensors[stored]
        index = ChunkIndex(saved.chunks)
        if saved.encoding is None:
            reads.extend(plan_reads(stored, saved, meta.files, leaf.pieces, index))
        else:  # the stored rows into buffers, decoded into the leaf once read
            encoded = plan_encoded_reads(stored, saved, meta.files, leaf.pieces, index)
            reads.extend(encoded.reads)
            plan.decodes.extend(encoded.decodes)
    return reads


def _check_files(storage: Storage, meta: Metadata, reads: list[ReadItem]) -> None:
    ends: dict[str, int] = {}
    for r in reads:
        ends[r.file] = max(ends.get(r.file, 0), r.chunk.byte_offset + r.chunk.stored_nbytes)
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


def _set_values(plan: _Plan, comm: Comm, allow_pickle: bool) -> None:
    meta, skipped = plan.meta, set(plan.match.differ)
    for key, leaf in plan.flat.values.items():
        if key in meta.objects and key not in skipped and leaf.setter is not None:
            leaf.setter(decode_value(meta.objects[key], key, allow_pickle))
    for key, holder in plan.flat.per_rank.items():
        if key not in meta.per_rank or key in skipped:
            continue
        if callable(holder.on_world_change) and needs_reshard(meta, key, comm.world_size):
            _reshard_value(meta, key, holder, comm, allow_pickle)
            continue
        found, encoded = meta.per_rank_value(key, comm.rank)
        if found:
            holder.value = decode_value(encoded, key, allow_pickle)
        if not found or meta.world_size != comm.world_size:
            warnings.warn(
                f"'{key}': {_per_rank_story(meta, key, comm.world_size)}; ranks with a saved "
                "value get it back, the others keep their current value (PerRank(..., "
                "on_world_change='error') refuses such a load).",
                stacklevel=6,
            )


def _reshard_value(
    meta: Metadata, key: str, holder: PerRank, comm: Comm, allow_pickle: bool
) -> None:
    """A PerRank value through its own function (see :mod:`unickpt.planning.per_rank`)."""
    assert callable(holder.on_world_change)
    got = reshard(meta, key, holder.on_world_change, comm.world_size, comm.rank, allow_pickle)
    holder.value = got.value
    if got.missing:
        warnings.warn(missing_warning(meta, key, got.missing, comm.world_size), stacklevel=7)


class RankReads:
    """The reads a load of ``state`` makes on this rank, planned from a checkpoint's metadata
    and only the indexes they need: :meth:`index_files` names those, :meth:`plan` reads them
    (from a storage that may serve them from elsewhere) and plans the reads."""

    def __init__(self, storage: Storage, state: dict[str, Any]) -> None:
        _, meta = read_metadata(storage)
        flat = flatten_state(state, for_load=True)
        found = match_keys(meta, flat, strict=False)  # mismatches are the load's to report
        self._plan = _Plan(meta, flat, found, SavedKeys.of(meta), SavedChunks(storage, meta))
        self._wanted = _wanted(self._plan)

    def index_files(self) -> list[str]:
        """The index files the reads are planned from."""
        assert self._plan.chunks is not None
        files = self._plan.chunks.files_for(self._wanted)
        return sorted(self._plan.meta.file_refs[i].index for i in files)

    def plan(self, storage: Storage) -> list[ReadItem]:
        """The reads, with their chunks from the index files of ``storage``."""
        self._plan.meta = SavedChunks(storage, self._plan.meta).load(self._wanted)
        return _plan_all_reads(self._plan)
