"""The commands of ``unickpt``: each one's summary, and what their parsers share."""

from __future__ import annotations

import argparse
from typing import Any

# Each command and its one-line summary: its help in ``unickpt --help`` (shown without
# importing the command's module) and in its own parser.
COMMANDS = {
    "demo": "train a small GPT, kill a worker, resume on another world size, compare",
    "inspect": "list the tensors and values of a checkpoint",
    "verify": "check a checkpoint's files and checksums",
    "diff": "compare two checkpoints",
    "convert": "export to safetensors, torch or dcp, or import from them",
    "bench": "benchmark checkpoint save/load against DCP, torch.save and other systems",
    "run": "launch a training script, with spares that replace failed ranks in place",
}


def add_command(
    subparsers: argparse._SubParsersAction, name: str, description: str, **kwargs: Any
) -> argparse.ArgumentParser:
    """The parser of command ``name``, its ``description`` shown as written."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=COMMANDS[name],
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )
    return parser


def add_progress_option(parser: argparse.ArgumentParser) -> None:
    """Adds ``--progress``: a progress bar also where stderr is not a terminal."""
    parser.add_argument(
        "--progress",
        action="store_true",
        help="draw a progress bar on stderr even when it is not a terminal",
    )
