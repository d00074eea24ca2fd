"""``unickpt verify PATH``: check every byte of a checkpoint against its checksums."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ..checkpointer import open_checkpoint
from ..errors import CheckpointError
from ..tools.progress import progress_bar, wants_progress
from ..tools.units import format_bytes
from ..tools.verify import VerifyReport, verify_checkpoint
from .steps import PATH_HELP, add_step_option

_DESCRIPTION = """\
Check a checkpoint without loading it: the commit marker, the metadata's size and checksum,
that every data file exists with the right size, and the checksum of every segment of every
stored chunk (read in parallel, in pieces of bounded size). Prints a summary; on damage, names
the file, the tensor and the byte range, and exits with status 1.

exit status: 0 intact, 1 damaged, 2 no checkpoint or other error"""

_SHOWN = 20


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``verify`` command."""
    parser = subparsers.add_parser(
        "verify",
        help="check a checkpoint's files and checksums",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", help=PATH_HELP)
    add_step_option(parser)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="parallel reads (default: the io_threads setting, 4)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--progress",
        action="store_true",
        help="draw a progress bar on stderr even when it is not a terminal",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        with progress_bar("verifying", wants_progress(args.progress)) as progress:
            source = open_checkpoint(args.path, args.step)
            report = verify_checkpoint(source, io_threads=args.threads, progress=progress)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    else:
        print(render(report))
    return 0 if report.ok else 1


def render(r: VerifyReport) -> str:
    figures = (
        f"{r.files} data file{'s' if r.files != 1 else ''}, {r.chunks} chunks, {r.segments} "
        f"segments, {format_bytes(r.bytes_verified)} verified in {r.elapsed_s:.2f} s "
        f"({r.mb_per_s:.1f} MB/s)"
    )
    if r.ok:
        return f"OK: {r.path}: {figures}"
    lines = [f"DAMAGED: {r.path}: {len(r.damage)} problem{'s' if len(r.damage) != 1 else ''}"]
    lines += [f"  - {d.message}" for d in r.damage[:_SHOWN]]
    if len(r.damage) > _SHOWN:
        lines.append(f"  ... and {len(r.damage) - _SHOWN} more (see --json)")
    lines.append(f"checked: {figures}")
    return "\n".join(lines)
