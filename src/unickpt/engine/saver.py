"""A save, step by step: prepare (flatten, plan, exchange), snapshot, write, commit.

:func:`prepare` runs in the caller's thread on every rank and ends with the plan every rank
agrees on. :func:`write_and_commit` can run in a background thread: each rank writes its data
file and its index (chunks and checksums), the coordinator gathers the file references, writes
the metadata and the commit marker, and every rank learns the outcome.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from .._version import __version__
from ..config import Config, get_config
from ..dist import Comm, RankFailure, failure_of, on_reset, raise_failures, run_step
from ..encoding.rowwise import ErrorSums
from ..encoding.saving import (
    EncodedTable,
    encode_leaves,
    merge_errors,
    with_encodings,
    written_errors,
)
from ..errors import CheckpointError, CheckpointExistsError
from ..format.chunk_map import ChunkMap
from ..format.codec import encode_index
from ..format.dtypes import dtype_name
from ..format.metadata import (
    FORMAT_VERSION,
    PER_RANK_ABSENT,
    PLAIN_FORMAT_VERSION,
    ChunkMeta,
    EncodingError,
    FileRef,
    Metadata,
    TensorMeta,
)
from ..format.references import FileLocation
from ..format.values import encode_value, needs_pickle
from ..layouts.arrays import distinct
from ..layouts.boxes import Box
from ..planning.flatten import Flattened, flatten_state
from ..planning.load_keys import KeyMap
from ..planning.packed import (
    PackedPlan,
    first_holders,
    shared_parts,
    with_shared,
    without_shared,
)
from ..planning.save_keys import rename_for_save
from ..planning.save_plan import GlobalPlan, LocalPlan, TensorDecl, WriteItem, build_global_plan
from ..storage.base import Storage
from .bounded import Stager
from .checksum import digest
from .commit import commit, data_name, index_name, metadata_name, read_commit
from .incremental import IncrementalSave, Piece, relaid
from .references import dependents
from .replicas import reduce_replicas, replica_specs
from .timeline import Timeline
from .write import ItemSource, WriteResult, write_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _CachedPlan:
    """The plan of the last structure saved, with this rank's signature, its rank among how
    many, and the share size it was made with."""

    plan: GlobalPlan
    signature: str
    rank: int
    world_size: int
    share_bytes: int


_PLAN_CACHE: dict[str, _CachedPlan] = {}
on_reset(_PLAN_CACHE.clear)  # a plan of the job's old membership is never offered again


def _plan_key(signatures: tuple[str, ...]) -> str:
    return hashlib.blake2b(repr(signatures).encode(), digest_size=16).hexdigest()


@dataclass
class PreparedSave:
    """What one rank needs after planning: its items, their sources, the encoded values it
    sends at the commit (its plain values by the plan, and its per-rank values)."""

    comm: Comm
    save_id: str
    plan: GlobalPlan
    items: tuple[WriteItem, ...]
    views: list[torch.Tensor]
    values: dict[str, Any]
    per_rank: dict[str, Any]
    plan_cached: bool
    release: Callable[[], None] | None = None
    incremental: IncrementalSave | None = None
    """Set by a Checkpointer with ``incremental=True``: skip chunks its last save stored."""
    encoded: dict[str, EncodedTable] = field(default_factory=dict)
    encoding_errors: dict[str, ErrorSums] = field(default_factory=dict)
    compress: bool = False
    """Store chunks compressed (:mod:`unickpt.engine.compress`; format version 3)."""
    plan_s: float = 0.0
    """Seconds :func:`prepare` took (flattening, encoding, agreeing on the plan)."""
    state_keys: dict[str, str] = field(default_factory=dict)
    """The state's key of each saved key that ``keys=`` renamed."""

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    def state_key(self, key: str) -> str:
        return self.state_keys.get(key, key)


def local_plan(flat: Flattened) -> LocalPlan:
    tensors = {
        k: TensorDecl(dtype_name(t.dtype), t.shape, t.layout, tuple(b for b, _ in t.pieces))
        for k, t in flat.tensors.items()
    }
    return LocalPlan(
        tensors, tuple(sorted(flat.values)), tuple(sorted(flat.per_rank)), dict(flat.aliases)
    )


def prepare(
    comm: Comm,
    storage: Storage,
    state: dict[str, Any],
    allow_pickle: bool,
    overwrite: bool,
    quantize: Mapping[str, int] | None = None,
    lock: bool = True,
    keys: KeyMap | None = None,
    failed: BaseException | None = None,
    config: Config | None = None,
) -> PreparedSave:
    """Flatten, encode values, agree on the plan (cached while the structure is unchanged).

    ``quantize`` (table key -> bits) stores those tables quantized per row (see
    :mod:`unickpt.encoding.rowwise`). ``lock=False``: the caller holds a lock that covers
    ``storage`` (a Checkpointer holds its root's), so the save takes none of its own.
    ``keys`` renames the state's keys to the saved ones (:func:`rename_for_save`).
    ``failed``: what failed on this rank before the save (a zero-stall save's capture), raised
    in the planning step, so that every rank raises it instead of waiting for this one. The
    coordinator's ``config.replica_share_bytes`` decides for every rank which replicated boxes
    are written in shares.
    """
    t0 = time.perf_counter()
    held: list[Callable[[], None]] = []
    encoded: dict[str, EncodedTable] = {}
    state_keys: dict[str, str] = {}

    def describe() -> tuple[Any, Any]:
        if failed is not None:
            raise failed
        renamed = rename_for_save(flatten_state(state), keys)
        flat = renamed.flat
        state_keys.update(renamed.state_keys)
        if quantize:
            encoded.update(encode_leaves(flat, quantize))
        plan = local_plan(flat)
        # Every rank encodes its values (in parallel, so no slower than one rank doing it) and
        # learns from the plan which of them it sends: the lowest rank holding a key does.
        values = {k: encode_value(v.value, k, allow_pickle) for k, v in flat.values.items()}
        per_rank = {k: encode_value(v.value, k, allow_pickle) for k, v in flat.per_rank.items()}
        extra = None
        if comm.is_coordinator:
            if lock:
                held.append(storage.acquire_lock())
            if read_commit(storage) is not None:
                _check_replaceable(storage, overwrite)
            extra = (uuid.uuid4().hex[:12], (config or get_config()).replica_share_bytes)
        cached_key = next(iter(_PLAN_CACHE), None)
        packed = plan.packed()
        ids = (packed.table_id, packed.kinds_id)
        shared = (packed.signature(), cached_key, extra, ids, replica_specs(flat))
        return (flat, packed, values, per_rank), shared

    local: Any = None
    mine: Any = None
    failure: RankFailure | None = None
    caught: BaseException | None = None
    try:
        try:
            local, mine = describe()
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            failure, caught = failure_of(comm.rank, e), e
        reused = _reused_plan(comm, mine if failure is None else None)
        cached = reused is not None
        if reused is not None:
            (save_id, share_bytes), global_plan = reused
        else:
            gathered = comm.all_gather((failure, mine))
            raise_failures(comm, "planning the save", [f for f, _ in gathered], caught)
            shared = [s for _, s in gathered]
            save_id, share_bytes = shared[0][2]
            key = _plan_key((*(s for s, *_ in shared), str(share_bytes)))
            cached = all(c == key for _, c, *_ in shared)
            flat = local[0]
            reduce_replicas(comm, flat, [r for *_, r in shared])  # Replicated tensors, if any
            entry = _PLAN_CACHE.get(key) if cached else None
            if entry is None:
                plan = _agree_on_plan(comm, local[1], [s[3] for s in shared], share_bytes)
                entry = _CachedPlan(plan, mine[0], comm.rank, comm.world_size, share_bytes)
                _PLAN_CACHE.clear()
                _PLAN_CACHE[key] = entry
            global_plan = entry.plan
    except BaseException:
        for undo in held:
            undo()
        raise
    flat, _, values, per_rank = local
    items = global_plan.writes(comm.rank)
    views = _views_for(flat, items)
    release = held[0] if held else None
    sent = {k: values[k] for k in global_plan.values_of(comm.rank)}
    return PreparedSave(
        comm,
        save_id,
        global_plan,
        items,
        views,
        sent,
        per_rank,
        cached,
        release,
        encoded=encoded,
        encoding_errors=written_errors(items, encoded),
        plan_s=time.perf_counter() - t0,
        state_keys=state_keys,
    )


def _reused_plan(comm: Comm, mine: Any) -> tuple[tuple[str, int], GlobalPlan] | None:
    """The coordinator's (save id, share size) and the cached plan, where every rank described
    its state (``mine``, None where it failed) with the structure, and at the rank, of the plan
    every rank has cached, the coordinator with the same share size, and no rank holds
    Replicated tensors (their copies are compared by the full exchange); else None. Ranks that
    all cached one plan, of as many ranks as they are, each at its rank then, are the ranks
    that made it. One all-reduce of five integers and one broadcast: a save of an unchanged
    structure exchanges as much per rank at any world size."""
    entry = _PLAN_CACHE.get(mine[1]) if mine is not None and mine[1] is not None else None
    fresh = (
        entry is not None
        and entry.signature == mine[0]
        and (entry.rank, entry.world_size) == (comm.rank, comm.world_size)
        and not mine[4]
        and (mine[2] is None or mine[2][1] == entry.share_bytes)
    )
    key = (int(mine[1][:15], 16), int(mine[1][15:30], 16)) if fresh else (0, 0)
    agreed = comm.max_across(np.array([not fresh, *key, -key[0], -key[1]], dtype=np.int64))
    if agreed[0] or agreed[1] != -agreed[3] or agreed[2] != -agreed[4]:
        return None
    assert entry is not None
    return comm.broadcast(mine[2]), entry.plan


def _check_replaceable(storage: Storage, overwrite: bool) -> None:
    """A committed checkpoint is replaced only when asked to, and never while other
    checkpoints' incremental saves refer to its bytes (the replacement deletes them)."""
    if not overwrite:
        raise CheckpointExistsError(
            f"{storage.location} already holds a committed checkpoint; pass overwrite=True to "
            "replace it (the old one stays loadable until the new one is committed), or save to "
            "a new path."
        )
    referring = dependents(storage)
    if referring:
        raise CheckpointError(
            f"{storage.location} holds a committed checkpoint whose bytes the incremental "
            f"checkpoints in {', '.join(referring)} refer to; replacing it would break them. "
            "Save under a new step, or delete those checkpoints first. Nothing was written."
        )


def _agree_on_plan(
    comm: Comm, plan: PackedPlan, ids: list[tuple[bytes, bytes]], share_bytes: int
) -> GlobalPlan:
    """Exchange the local plans and build the global one. Pure and run on every rank over the
    same plans; run_step still gathers the outcome, so that a rank failing alone (out of
    memory) cannot leave the others waiting."""
    plans = _exchange_plans(comm, plan, ids)

    def build() -> tuple[GlobalPlan, None]:
        return build_global_plan(plans, share_bytes), None

    built, _ = run_step(comm, "planning the save", build)
    return built


def _exchange_plans(
    comm: Comm, plan: PackedPlan, ids: list[tuple[bytes, bytes]]
) -> list[PackedPlan]:
    """Every rank's plan. Ranks split alike send equal tables and kinds (``ids``: their
    digests, already exchanged): each distinct one is broadcast once by the first rank holding
    it, and the plans are all-gathered without them, so a rank receives a few rows per rank
    rather than every rank's table."""
    owners = first_holders(ids)
    gathered = comm.all_gather(without_shared(plan))
    parts: dict[bytes, Any] = {}
    for src in sorted(set(owners.values())):
        sent = shared_parts(plan, owners, src) if src == comm.rank else {}
        parts.update(comm.broadcast(sent, src))
    return [with_shared(p, parts) for p in gathered]


def _views_for(flat: Flattened, items: tuple[WriteItem, ...]) -> list[torch.Tensor]:
    """The view of each item: the piece the rank holds, or its rows the item is a share of."""
    by_box: dict[tuple[str, Box], torch.Tensor] = {
        (k, b): v for k, t in flat.tensors.items() for b, v in t.pieces
    }
    views = []
    for i in items:
        if i.held is None:
            views.append(by_box[(i.key, i.box)])
        else:
            views.append(by_box[(i.key, i.held)][i.box.relative_to(i.held)])
    return views


@dataclass(frozen=True)
class SaveReport:
    """Figures of one finished save on this rank."""

    bytes_written: int
    write_s: float
    commit_s: float
    plan_cached: bool
    encoding_errors: dict[str, EncodingError] = field(default_factory=dict)
    """For each quantized table, what quantization changed in its values."""
    timeline: dict[str, float] = field(default_factory=dict)
    """Seconds per phase on this rank (:data:`unickpt.engine.timeline.PHASES`): ``plan``;
    summed over the writer threads ``compress``, ``hash`` and ``write`` (into the storage);
    ``file`` (the data file's parts, wall), ``complete`` (its fsync and rename, with the
    index written meanwhile), ``gather`` (waiting for every rank) and ``commit`` (metadata and
    marker, on the coordinator)."""


def write_and_commit(
    prep: PreparedSave,
    storage: Storage,
    sources: list[ItemSource],
    config: Config,
    progress: Callable[[int, int], None] | None = None,
    check: Callable[[], None] | None = None,
    stager: Stager | None = None,
) -> SaveReport:
    """Write this rank's file, then commit on the coordinator; raise everywhere on failure.

    ``check()``, when given, runs before and after this rank's file is written; an error it
    raises fails the save on every rank and nothing is committed. With ``stager`` (a plain
    full save), the file's bytes are copied from ``sources`` through its bounded ring.
    """
    comm = prep.comm
    t0 = time.perf_counter()
    timeline = Timeline()
    timeline.add("plan", prep.plan_s)
    ref: FileRef | None = None
    failure: RankFailure | None = None
    caught: BaseException | None = None
    try:
        if check is not None:
            check()
        if prep.items:
            ref = _write_rank_files(prep, storage, sources, config, progress, stager, timeline)
        if check is not None:
            check()
    except Exception as e:  # noqa: BLE001 - reported to every rank
        failure, caught = failure_of(comm.rank, e), e
    write_s = time.perf_counter() - t0
    steps = prep.incremental.referenced_steps if prep.incremental else ()
    payload = (failure, ref, prep.per_rank, prep.values, steps, prep.encoding_errors)
    outcome: list[RankFailure | None] = [failure]
    errors: dict[str, EncodingError] = {}
    clean = True  # this save's files may go: it did not commit
    try:
        with timeline.timed("gather"):
            gathered = comm.gather(payload)
        if comm.is_coordinator:
            assert gathered is not None
            outcome = [g[0] for g in gathered]
            if not any(outcome):
                try:
                    errors = merge_errors([g[5] for g in gathered])
                    with timeline.timed("commit"):
                        meta = _metadata(prep, gathered, config, errors)
                        commit(storage, meta, prep.save_id)
                except Exception as e:  # noqa: BLE001 - reported to every rank
                    outcome = [failure_of(comm.rank, e)]
                    caught = e
                    clean = _proven_uncommitted(storage, prep.save_id)
    finally:
        if prep.release is not None:
            prep.release()
    failed: list[RankFailure | None] = [f for f in outcome if f is not None]  # few bytes
    outcome, errors, clean = comm.broadcast((failed, errors, clean))
    if any(outcome) and clean:
        _remove_own_files(storage, prep.save_id, comm.rank, comm.is_coordinator)
    raise_failures(comm, "saving", outcome, caught)
    if prep.incremental is not None:
        prep.incremental.adopt()
    total = ref.nbytes if ref else 0
    commit_s = time.perf_counter() - t0 - write_s
    return SaveReport(total, write_s, commit_s, prep.plan_cached, errors, timeline.seconds())


def _proven_uncommitted(storage: Storage, save_id: str) -> bool:
    """After a failed commit: whether the marker is read and is not this save's (a marker
    that cannot be read may be this save's, whose files must then stay)."""
    try:
        record = read_commit(storage)
    except CheckpointError:
        return False
    return record is None or record.save_id != save_id


def _remove_own_files(storage: Storage, save_id: str, rank: int, coordinator: bool) -> None:
    """A failed save takes its files with it (they bear its id, so nothing else needs them):
    space taken by a save that failed at its commit would fail every later one."""
    names = [data_name(save_id, rank), index_name(save_id, rank)]
    if coordinator:
        names.append(metadata_name(save_id))
    try:
        storage.remove_many(names)
    except CheckpointError as e:
        log.warning("could not remove the files of the failed save in %s (%s)", storage.location, e)


def _write_rank_files(
    prep: PreparedSave,
    storage: Storage,
    sources: list[ItemSource],
    config: Config,
    progress: Callable[[int, int], None] | None,
    stager: Stager | None = None,
    timeline: Timeline | None = None,
) -> FileRef:
    """This rank's data file and its index (chunks and checksums); both durable. The index is
    written once every part is, while the data file is completed."""
    name = data_name(prep.save_id, prep.comm.rank)
    inc = prep.incremental
    written: list[FileRef] = []

    def write_index(
        result: WriteResult,
        chunks: list[list[ChunkMeta]],
        refs: list[FileLocation],
        content: Sequence[tuple[str, ...]] = (),
    ) -> None:
        if inc is not None:
            inc.record(name, prep.items, chunks, refs, content)
        entries = [(it.key, cs[0]) for it, cs in zip(prep.items, chunks) if len(cs) == 1]
        runs = [(it.key, cs) for it, cs in zip(prep.items, chunks) if len(cs) > 1]  # row deltas
        raw = encode_index(name, entries, refs, runs)
        index = index_name(prep.save_id, prep.comm.rank)
        storage.write_atomic(index, raw)
        written.append(FileRef(name, result.nbytes, index, len(raw), digest(memoryview(raw))))

    if inc is None or inc.full:
        if inc is not None:
            inc.digest_rows(prep.items, sources)

        def write_full_index(result: WriteResult) -> None:
            chunks = [
                [ChunkMeta(i.box.offsets, i.box.lengths, 0, at, i.nbytes, sums, packed)]
                for i, sums, (at, packed) in zip(
                    prep.items, result.checksums, result.placements(prep.items)
                )
            ]
            write_index(result, chunks, [], result.raw_checksums)

        write_file(
            storage,
            name,
            prep.items,
            sources,
            config,
            progress,
            alongside=write_full_index,
            compress=_compressed(prep, prep.items),
            stager=stager,
            timeline=timeline,
        )
    else:
        if stager is not None:
            raise AssertionError("an incremental save is not staged through a bounded ring")
        _write_changed(prep, inc, storage, name, sources, config, progress, write_index, timeline)
    return written[0]


def _write_changed(
    prep: PreparedSave,
    inc: IncrementalSave,
    storage: Storage,
    name: str,
    sources: list[ItemSource],
    config: Config,
    progress: Callable[[int, int], None] | None,
    write_index: Callable[..., None],
    timeline: Timeline | None = None,
) -> None:
    """Hash every item, write the changed pieces back to back, refer to the others; the index
    is written with ``write_index`` while the data file is completed."""
    pieces = inc.plan(prep.items, sources, config.io_threads)
    writes = [p for ps in pieces for p in ps if p.stored is None]
    laid = relaid([WriteItem("", p.box, 0, _nbytes(p)) for p in writes])
    write_sources = [p.source for p in writes if p.source is not None]
    refs = sorted({p.stored.location for ps in pieces for p in ps if p.stored is not None})
    number = {loc: n + 1 for n, loc in enumerate(refs)}
    at = iter(laid)
    content = [ps[0].checksums if len(ps) == 1 else () for ps in pieces]  # raw, by the plan
    chunks: list[list[ChunkMeta]] = []
    for ps in pieces:
        out = []
        for p in ps:
            if p.stored is None:
                it = next(at)
                out.append(
                    ChunkMeta(
                        p.box.offsets, p.box.lengths, 0, it.byte_offset, it.nbytes, p.checksums
                    )
                )
            else:
                s = p.stored
                out.append(
                    ChunkMeta(
                        p.box.offsets,
                        p.box.lengths,
                        number[s.location],
                        s.byte_offset,
                        s.nbytes,
                        s.checksums,
                        s.compression,
                    )
                )
        chunks.append(out)
    log.debug(
        "incremental save: %d pieces written, %d referred to",
        len(writes),
        sum(map(len, pieces)) - len(writes),
    )
    write_file(
        storage,
        name,
        laid,
        write_sources,
        config,
        progress,
        [p.checksums for p in writes],
        alongside=lambda result: write_index(result, _placed(chunks, result), refs, content),
        compress=_compressed(
            prep, [it for it, ps in zip(prep.items, pieces) for p in ps if p.stored is None]
        ),
        timeline=timeline,
    )


def _compressed(prep: PreparedSave, written: Sequence[WriteItem]) -> list[bool]:
    """Which of the chunks written are compressed: all with ``compress``, but those of tables
    an incremental save compares row by row (later saves refer to rows of their bytes)."""
    inc = prep.incremental
    return [prep.compress and not (inc and inc.basis.tracks_rows(it)) for it in written]


def _placed(chunks: list[list[ChunkMeta]], result: WriteResult) -> list[list[ChunkMeta]]:
    """The chunks, those written (``file`` 0, in order) placed and compressed as the write
    of ``result`` stored them; unchanged when it stored them as laid out."""
    if not result.placed:
        return chunks
    written = iter(zip(result.placed, result.checksums))
    out = []
    for cs in chunks:
        row = []
        for c in cs:
            if c.file == 0:
                (at, packed), sums = next(written)
                c = replace(c, byte_offset=at, checksums=sums, compression=packed)
            row.append(c)
        out.append(row)
    return out


def _nbytes(p: Piece) -> int:
    assert p.source is not None
    return p.source.view.numel() * p.source.view.element_size()


def _metadata(
    prep: PreparedSave, gathered: list[Any], config: Config, errors: dict[str, EncodingError]
) -> Metadata:
    refs = tuple(g[1] for g in gathered if g[1] is not None)
    referenced = tuple(sorted({s for g in gathered for s in g[4]}))
    tensors = {
        k: TensorMeta(dtype, shape, layout, ())
        for k, (dtype, shape, layout) in prep.plan.tensors.items()
    }
    tensors = with_encodings(tensors, prep.encoded, errors)
    values = {k: gathered[rank][3][k] for k, rank in prep.plan.value_writers.items()}
    per_rank = {
        k: tuple(g[2].get(k, PER_RANK_ABSENT) for g in gathered) for k in prep.plan.per_rank_keys
    }
    pickled = [k for k, v in values.items() if needs_pickle(v)]
    pickled += [k for k, v in per_rank.items() if any(needs_pickle(x) for x in v)]
    return Metadata(
        world_size=prep.comm.world_size,
        files=tuple(r.data for r in refs),
        tensors=tensors,
        objects=values,
        per_rank=per_rank,
        aliases=dict(prep.plan.aliases),
        segment_bytes=config.segment_bytes,
        version=FORMAT_VERSION if prep.compress else PLAIN_FORMAT_VERSION,
        created_unix_s=time.time(),
        producer={"unickpt": __version__, "torch": torch.__version__},
        pickled_keys=tuple(sorted(pickled)),
        file_refs=refs,
        references=referenced,
        chunk_map=_chunk_map(prep.plan, [g[1] is not None for g in gathered]),
    )


def _chunk_map(plan: GlobalPlan, has_file: list[bool]) -> ChunkMap | None:
    """Where each chunk of the plan is listed: the file of the rank that writes it (ranks
    without a file are left out of the metadata's files). Kept with the plan, which later
    saves of the same structure reuse."""
    kept = _MAPS.get(plan)
    if kept is not None and kept[0] == tuple(has_file):
        return kept[1]
    position = np.cumsum(has_file) - 1
    writing = {w for lay in plan.layouts for w in distinct(lay.writers).tolist()}
    found = plan.chunk_map(position) if all(has_file[w] for w in writing) else None
    _MAPS[plan] = (tuple(has_file), found)
    return found


_MAPS: weakref.WeakKeyDictionary[GlobalPlan, tuple[tuple[bool, ...], ChunkMap | None]] = (
    weakref.WeakKeyDictionary()
)


def expected_segments(nbytes: int, segment: int) -> int:
    return max(1, math.ceil(nbytes / segment))
