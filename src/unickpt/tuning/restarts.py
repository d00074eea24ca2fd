"""Restarts seen under a Checkpointer root, and the mean time between failures they imply.

A training job that tunes its interval records when it started in ``starts.json`` at the root
(``{"format": "unickpt-starts", "version": 1, "starts_unix_s": [...]}``, the last 100 starts).
Every start after the first counts as a restart after a failure, so ``n`` starts over ``t``
seconds give an MTBF of ``t / (n - 1)``. Step folders are the only other names at a root;
readers and retention ignore this file.
"""

from __future__ import annotations

import json
import logging

from ..errors import CheckpointError
from ..storage.base import Storage

log = logging.getLogger(__name__)

STARTS_FILE = "starts.json"
_KEPT = 100


def read_starts(root: Storage) -> list[float]:
    """The recorded starts (unix seconds, ascending); none when absent or unreadable."""
    raw = root.read_bytes(STARTS_FILE)
    if raw is None:
        return []
    try:
        doc = json.loads(raw.decode("utf-8"))
        return sorted(float(s) for s in doc["starts_unix_s"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        log.warning("ignoring %s/%s (%s)", root.location, STARTS_FILE, e)
        return []


def record_start(root: Storage, now_unix_s: float) -> list[float]:
    """Add a start to the root's record; the starts including it."""
    starts = ([*read_starts(root), now_unix_s])[-_KEPT:]
    doc = {"format": "unickpt-starts", "version": 1, "starts_unix_s": starts}
    try:
        root.write_atomic(STARTS_FILE, json.dumps(doc).encode("utf-8"))
    except CheckpointError as e:
        log.warning("could not record this start at %s (%s)", root.location, e)
    return starts


def mtbf_from_starts(starts: list[float], now_unix_s: float) -> float | None:
    """Time since the first start over the number of restarts; None before any restart."""
    if len(starts) < 2:
        return None
    elapsed = now_unix_s - starts[0]
    return elapsed / (len(starts) - 1) if elapsed > 0.0 else None
