"""The ``--step`` option of the commands that read a checkpoint or a Checkpointer root, and
how those commands find the checkpoint a path names."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..storage.base import Storage

PATH_HELP = (
    "checkpoint folder (holds a COMMIT file), or a Checkpointer root (its newest committed "
    "step is used); a path or URL"
)

# Where a Hugging Face Trainer checkpoint-N folder keeps its unickpt checkpoint.
HF_SUBFOLDER = "unickpt"


def add_step_option(parser: argparse.ArgumentParser, applies_to: str = "PATH") -> None:
    """Adds ``--step N``: which step of a Checkpointer root to read."""
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help=f"when {applies_to} is a Checkpointer root, read step N instead of the newest",
    )


def open_source(path: str, step: int | None) -> Storage:
    """The checkpoint ``path`` names (a checkpoint, or a root's newest or ``step``-th step).
    A folder that holds none but whose ``unickpt/`` subfolder does (a Hugging Face Trainer
    ``checkpoint-N``) raises an error that names the subfolder."""
    from ..errors import CheckpointError, CheckpointNotFoundError
    from ..format.metadata import COMMIT_FILE
    from ..root.names import open_checkpoint

    chosen = open_checkpoint(path, step)
    try:
        if chosen.size(COMMIT_FILE) is not None:
            return chosen
        inner = chosen.child(HF_SUBFOLDER)
        found = inner.size(COMMIT_FILE) is not None
    except CheckpointError:
        return chosen  # reading it says what is wrong
    if found:
        suggestion = f"{path.rstrip('/')}/{HF_SUBFOLDER}"
        raise CheckpointNotFoundError(
            f"no checkpoint at {chosen.location}, but its subfolder {HF_SUBFOLDER}/ holds one "
            "(a Hugging Face Trainer checkpoint-N folder keeps its unickpt checkpoint there); "
            f"pass {suggestion}."
        )
    return chosen
