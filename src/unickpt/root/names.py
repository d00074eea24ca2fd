"""The layout of a Checkpointer root: one folder per step, counted only once committed.

A root holds ``step-%09d`` folders (``step-000000100``), each an ordinary checkpoint; a step
is committed once its folder holds the ``COMMIT`` marker. The newest committed step is the one
with the largest number whose folder holds the marker; folders without one are an interrupted
save's debris. The root's identity file (``ROOT_ID``, :mod:`.identity`) and the restart
records (``starts.json``) sit beside the step folders.

Listing and reading the markers run on the rank that calls them, and raise when a request
fails: a failed listing is never taken for an empty one.
"""

from __future__ import annotations

import os
import re

from ..errors import CheckpointError, CheckpointNotFoundError
from ..format.metadata import COMMIT_FILE
from ..storage.base import Storage
from ..storage.registry import open_storage

_STEP = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    """The folder name of ``step`` under a Checkpointer root."""
    return f"step-{step:09d}"


def step_of(name: str) -> int | None:
    """The step a folder name stands for, or None when it is not a step folder."""
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def step_folders(root: Storage) -> dict[int, str]:
    """Every step folder under ``root`` (committed or not), by step."""
    return {step: n for n in root.list_names() if (step := step_of(n)) is not None}


def committed_steps(root: Storage) -> list[int]:
    """Steps whose folder holds a commit marker, ascending (folders without one are ignored)."""
    return sorted(
        s
        for s, name in step_folders(root).items()
        if root.child(name).size(COMMIT_FILE) is not None
    )


def open_checkpoint(location: str | os.PathLike[str] | Storage, step: int | None = None) -> Storage:
    """The checkpoint at ``location``; for a Checkpointer root, its newest committed step, or
    ``step`` when given.

    >>> reader = CheckpointReader(open_checkpoint("runs/gpt"))  # doctest: +SKIP
    """
    storage = open_storage(location)
    is_checkpoint = storage.size(COMMIT_FILE) is not None
    if step is None and is_checkpoint:
        return storage
    if step is not None and is_checkpoint:
        raise CheckpointError(
            f"{storage.location} is a checkpoint, not a Checkpointer root (a folder of step-N "
            "folders); a step applies to roots. Leave out the step or pass the root."
        )
    folders = step_folders(storage)
    if step is None and not folders:
        return storage  # not a root either: loading it says what is there
    committed = committed_steps(storage)
    if step is None and not committed:
        raise CheckpointNotFoundError(
            f"{storage.location} is a Checkpointer root whose {len(folders)} step folder(s) hold "
            "no committed checkpoint: the saves that wrote them did not finish."
        )
    if step is not None and step not in committed:
        listed = ", ".join(map(str, committed[-10:])) or "none"
        raise CheckpointNotFoundError(
            f"step {step} is not a committed checkpoint of {storage.location}; its committed "
            f"steps are: {listed}. Pass one of them."
        )
    return storage.child(step_name(committed[-1] if step is None else step))
