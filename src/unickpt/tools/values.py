"""The Python values of a checkpoint, decoded for an export (never unpickled)."""

from __future__ import annotations

import logging
from typing import Any

from ..engine.tensor_reader import CheckpointReader
from ..errors import UnsafeObjectError
from .selection import Selection

log = logging.getLogger(__name__)


def decode_values(
    reader: CheckpointReader, selection: Selection
) -> tuple[dict[str, Any], list[str]]:
    """Values by output name, and ``"key: reason"`` for each one left out.

    Values saved with pickle are left out (an export never runs code from a checkpoint). A
    per-rank value becomes the value of the lowest rank that saved one.
    """
    meta = reader.metadata
    out: dict[str, Any] = {}
    left_out: list[str] = []
    for name, key in selection.values.items():
        if key in meta.pickled_keys:
            left_out.append(f"{key}: saved with pickle")
            continue
        first = meta.first_per_rank(key) if key in meta.per_rank else None
        if key in meta.per_rank and first is None:
            left_out.append(f"{key}: per-rank value with no rank's value stored")
            continue
        rank = first[0] if first is not None else 0
        try:
            out[name] = reader.read_value(key, rank=rank)
        except UnsafeObjectError:
            left_out.append(f"{key}: saved with pickle")
            continue
        if key in meta.per_rank and len(meta.per_rank[key]) > 1:
            log.info("'%s' is a per-rank value; exporting the value of rank %d", key, rank)
    return out, left_out


def warn_left_out(left_out: list[str], what: str) -> None:
    if left_out:
        shown = "; ".join(left_out[:10]) + (
            f"; and {len(left_out) - 10} more" if len(left_out) > 10 else ""
        )
        log.warning(
            "left out of the %s %d entr%s: %s",
            what,
            len(left_out),
            "y" if len(left_out) == 1 else "ies",
            shown,
        )
