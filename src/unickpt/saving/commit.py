"""The commit phase of a save (:func:`commit`): every rank's outcome gathered, the checkpoint
committed once.

Each rank sends what its write left (its files, or its failure), its per-rank values, the plain
values the plan gave it and its quantization errors to the coordinator, which, when no rank
failed, writes the metadata and then the commit marker (:func:`unickpt.engine.commit.commit`).
Every rank learns the outcome; a failure anywhere raises on every rank, and a save that did not
commit takes its own files with it.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._version import __version__
from ..dist import RankFailure, failure_of, raise_failures
from ..encoding.saving import merge_errors, with_encodings
from ..engine.commit import commit as commit_files
from ..engine.commit import data_name, index_name, metadata_name, read_commit
from ..engine.futures import SaveReport
from ..engine.timeline import Timeline
from ..errors import CheckpointError
from ..format.chunk_map import ChunkMap
from ..format.metadata import (
    FORMAT_VERSION,
    PER_RANK_ABSENT,
    PLAIN_FORMAT_VERSION,
    EncodingError,
    FileRef,
    Metadata,
    TensorMeta,
)
from ..format.values import needs_pickle
from ..layouts.arrays import distinct
from ..planning.save_plan import GlobalPlan
from ..storage.base import Storage
from .plan import PlannedSave
from .save import Save

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Written:
    """What the write phase left on this rank: its files, or the error that stopped it; the
    save's timeline so far (the plan's and the write's stages)."""

    ref: FileRef | None
    error: Exception | None
    seconds: float
    timeline: Timeline


def commit(save: Save, planned: PlannedSave, written: Written) -> SaveReport:
    """Phase 5: gather, commit on the coordinator, release the lock; raise everywhere on
    failure; then ``on_commit``."""
    t0 = time.perf_counter()
    storage, incremental, timeline = save.storage, save.options.incremental, written.timeline
    comm = planned.comm
    failure = None if written.error is None else failure_of(comm.rank, written.error)
    caught: BaseException | None = written.error
    steps = incremental.referenced_steps if incremental else ()
    payload = (
        failure,
        written.ref,
        planned.per_rank,
        planned.values,
        steps,
        planned.encoding_errors,
    )
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
                        meta = _metadata(save, planned, gathered, errors)
                        commit_files(storage, meta, planned.save_id)
                except Exception as e:  # noqa: BLE001 - reported to every rank
                    outcome = [failure_of(comm.rank, e)]
                    caught = e
                    clean = _proven_uncommitted(storage, planned.save_id)
    finally:
        if planned.release is not None:
            planned.release()
    failed: list[RankFailure | None] = [f for f in outcome if f is not None]  # few bytes
    outcome, errors, clean = comm.broadcast((failed, errors, clean))
    if any(outcome) and clean:
        _remove_own_files(storage, planned.save_id, comm.rank, comm.is_coordinator)
    raise_failures(comm, "saving", outcome, caught)
    if incremental is not None:
        incremental.adopt()
    total = written.ref.nbytes if written.ref else 0
    commit_s = time.perf_counter() - t0
    report = SaveReport(
        total, written.seconds, commit_s, planned.plan_cached, errors, timeline.seconds()
    )
    if save.options.on_commit is not None:
        save.options.on_commit()
    return report


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


def _metadata(
    save: Save, planned: PlannedSave, gathered: list[Any], errors: dict[str, EncodingError]
) -> Metadata:
    plan = planned.plan
    refs = tuple(g[1] for g in gathered if g[1] is not None)
    referenced = tuple(sorted({s for g in gathered for s in g[4]}))
    tensors = {
        k: TensorMeta(dtype, shape, layout, ())
        for k, (dtype, shape, layout) in plan.tensors.items()
    }
    tensors = with_encodings(tensors, planned.encoded, errors)
    values = {k: gathered[rank][3][k] for k, rank in plan.value_writers.items()}
    per_rank = {
        k: tuple(g[2].get(k, PER_RANK_ABSENT) for g in gathered) for k in plan.per_rank_keys
    }
    pickled = [k for k, v in values.items() if needs_pickle(v)]
    pickled += [k for k, v in per_rank.items() if any(needs_pickle(x) for x in v)]
    return Metadata(
        world_size=planned.comm.world_size,
        files=tuple(r.data for r in refs),
        tensors=tensors,
        objects=values,
        per_rank=per_rank,
        aliases=dict(plan.aliases),
        segment_bytes=save.config.segment_bytes,
        version=FORMAT_VERSION if save.options.compress else PLAIN_FORMAT_VERSION,
        created_unix_s=time.time(),
        producer={"unickpt": __version__, "torch": torch.__version__},
        pickled_keys=tuple(sorted(pickled)),
        file_refs=refs,
        references=referenced,
        chunk_map=_chunk_map(plan, [g[1] is not None for g in gathered]),
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
