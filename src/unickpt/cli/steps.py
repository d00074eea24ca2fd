"""The ``--step`` option of the commands that read a checkpoint or a Checkpointer root."""

from __future__ import annotations

import argparse

PATH_HELP = (
    "checkpoint folder (holds a COMMIT file), or a Checkpointer root (its newest committed "
    "step is used); a path or URL"
)


def add_step_option(parser: argparse.ArgumentParser, applies_to: str = "PATH") -> None:
    """Adds ``--step N``: which step of a Checkpointer root to read."""
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help=f"when {applies_to} is a Checkpointer root, read step N instead of the newest",
    )
