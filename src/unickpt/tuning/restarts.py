"""Restarts seen under a Checkpointer root, and the mean time between failures they imply.

A training job that tunes its interval records its start in ``starts.json`` at the root, with
the time of the newest save the job before it committed at the root::

    {"format": "unickpt-starts", "version": 2,
     "starts_unix_s": [s0, s1, ...], "last_saves_unix_s": [l0, l1, ...]}

``l_i`` (null when unknown) is filled in when start ``i + 1`` is recorded. Every start after
the first counts as a restart after a failure, and the MTBF is the running time over the
number of restarts. The running time of a finished job is the span from its start to its last
save (never past the next start), not the wall time to the next start: a job stopped on Friday
and started again on Monday ran until its last save, and the weekend is no time between
failures. A job that committed no save counts no running time (the MTBF errs short, so the
interval does too). Version 1 files (starts only) count the whole gap between starts.
Step folders are the only other names at a root; readers and retention ignore this file.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..engine.commit import read_checkpoint
from ..errors import CheckpointError
from ..root.names import committed_steps, step_name
from ..storage.base import Storage

log = logging.getLogger(__name__)

STARTS_FILE = "starts.json"
_KEPT = 100
_VERSION = 2


@dataclass(frozen=True)
class Start:
    """A job's start, and the newest save it committed before the next start (None: none
    known yet, or none made)."""

    start_unix_s: float
    last_save_unix_s: float | None = None


def read_starts(root: Storage) -> list[Start]:
    """The recorded starts (ascending); none when absent or unreadable."""
    raw = root.read_bytes(STARTS_FILE)
    if raw is None:
        return []
    try:
        return _parse(json.loads(raw.decode("utf-8")))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        log.warning("ignoring %s/%s (%s)", root.location, STARTS_FILE, e)
        return []


def _parse(doc: dict[str, Any]) -> list[Start]:
    starts = [float(s) for s in doc["starts_unix_s"]]
    if doc.get("version", 1) < 2:  # no save times: each job ran until the next start
        saves: list[float | None] = [*starts[1:], None]
    else:
        saves = [None if v is None else float(v) for v in doc["last_saves_unix_s"]]
        if len(saves) != len(starts):
            raise ValueError(f"{len(starts)} starts but {len(saves)} save times")
    return sorted((Start(s, v) for s, v in zip(starts, saves)), key=lambda s: s.start_unix_s)


def record_start(root: Storage, now_unix_s: float) -> list[Start]:
    """Add a start to the root's record, first noting the newest save of the job before; the
    starts including this one."""
    starts = read_starts(root)
    if starts and starts[-1].last_save_unix_s is None:
        saved = newest_save_unix_s(root)
        if saved is not None and starts[-1].start_unix_s <= saved:
            starts[-1] = replace(starts[-1], last_save_unix_s=min(saved, now_unix_s))
    starts = [*starts, Start(now_unix_s)][-_KEPT:]
    doc = {
        "format": "unickpt-starts",
        "version": _VERSION,
        "starts_unix_s": [s.start_unix_s for s in starts],
        "last_saves_unix_s": [s.last_save_unix_s for s in starts],
    }
    try:
        root.write_atomic(STARTS_FILE, json.dumps(doc).encode("utf-8"))
    except CheckpointError as e:
        log.warning("could not record this start at %s (%s)", root.location, e)
    return starts


def newest_save_unix_s(root: Storage) -> float | None:
    """When the newest committed step at ``root`` was saved; None without one."""
    try:
        steps = committed_steps(root)
        if not steps:
            return None
        _, meta = read_checkpoint(root.child(step_name(steps[-1])))
    except CheckpointError as e:
        log.info("no save time for the previous job at %s (%s)", root.location, e)
        return None
    return meta.created_unix_s or None


def running_s(starts: Sequence[Start], now_unix_s: float) -> float:
    """The time the jobs ran: each finished job from its start to its last save (capped by
    the next start), and the current job until ``now_unix_s``."""
    total = 0.0
    for start, following in itertools.pairwise(starts):
        end = start.last_save_unix_s
        if end is not None:
            total += max(0.0, min(end, following.start_unix_s) - start.start_unix_s)
    if starts:
        total += max(0.0, now_unix_s - starts[-1].start_unix_s)
    return total


def mtbf_from_starts(starts: Sequence[Start], now_unix_s: float) -> float | None:
    """Running time over the number of restarts; None before any restart or running time."""
    if len(starts) < 2:
        return None
    running = running_s(starts, now_unix_s)
    return running / (len(starts) - 1) if running > 0.0 else None
