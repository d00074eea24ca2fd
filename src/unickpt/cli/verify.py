"""``unickpt verify PATH``: check every byte of a checkpoint against its checksums."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from .commands import add_command, add_progress_option
from .errors import print_error
from .steps import PATH_HELP, add_step_option, open_source

if TYPE_CHECKING:
    from ..tools.verify import Damage, VerifyReport

_DESCRIPTION = """\
Check a checkpoint without loading it: the commit marker, the metadata's size and checksum,
that every data file exists with the right size, and the checksum of every segment of every
stored chunk (read in parallel, in pieces of bounded size). Prints a summary; on damage, one
line per damaged file: how many problems, the first tensors, and the first problem (file,
tensor, byte range); --json lists every problem. Exits with status 1.

exit status: 0 intact, 1 damaged, 2 no checkpoint or other error"""

_SHOWN = 20  # files
_KEYS_SHOWN = 3


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``verify`` command."""
    parser = add_command(subparsers, "verify", _DESCRIPTION)
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
    add_progress_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import CheckpointError
    from ..tools.progress import progress_bar, wants_progress
    from ..tools.verify import verify_checkpoint

    try:
        with progress_bar("verifying", wants_progress(args.progress)) as progress:
            source = open_source(args.path, args.step)
            report = verify_checkpoint(source, io_threads=args.threads, progress=progress)
    except CheckpointError as e:
        return print_error(e)
    if args.json:
        print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    else:
        print(render(report))
    return 0 if report.ok else 1


def render(r: VerifyReport) -> str:
    from ..units import format_bytes

    figures = (
        f"{r.files} data file{'s' if r.files != 1 else ''}, {r.chunks} chunks, {r.segments} "
        f"segments, {format_bytes(r.bytes_verified)} verified in {r.elapsed_s:.2f} s "
        f"({r.mb_per_s:.1f} MB/s)"
    )
    if r.ok:
        return f"OK: {r.path}: {figures}"
    by_file = group_by_file(r.damage)
    lines = [
        f"DAMAGED: {r.path}: {_count(len(r.damage), 'problem')} in {_count(len(by_file), 'file')}"
    ]
    lines += [f"  - {_file_line(name, found)}" for name, found in list(by_file.items())[:_SHOWN]]
    if len(by_file) > _SHOWN:
        lines.append(f"  ... and {len(by_file) - _SHOWN} more files (see --json)")
    lines.append(f"checked: {figures}")
    return "\n".join(lines)


def group_by_file(damage: Sequence[Damage]) -> dict[str, list[Damage]]:
    """The problems of each file, files in the order of their first problem."""
    out: dict[str, list[Damage]] = {}
    for d in damage:
        out.setdefault(d.file, []).append(d)
    return out


def _file_line(name: str, found: list[Damage]) -> str:
    """``name: N problems (tensors 'a', 'b' and 3 more); first: <message>``."""
    if len(found) == 1:
        return found[0].message
    keys = list(dict.fromkeys(d.key for d in found if d.key is not None))
    shown = ", ".join(f"'{k}'" for k in keys[:_KEYS_SHOWN])
    more = f" and {len(keys) - _KEYS_SHOWN} more" if len(keys) > _KEYS_SHOWN else ""
    tensors = f" ({_count(len(keys), 'tensor')}: {shown}{more})" if keys else ""
    return f"{name}: {len(found)} problems{tensors}; first: {found[0].message}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"
