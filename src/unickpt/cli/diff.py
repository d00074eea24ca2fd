"""``unickpt diff A B``: which tensors and values of two checkpoints differ, and by how much."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import TYPE_CHECKING

from .commands import add_command, add_progress_option
from .errors import print_error
from .steps import PATH_HELP, add_step_option, open_source

if TYPE_CHECKING:
    from ..storage.base import Storage
    from ..tools.diff import DiffReport, TensorDiff, ValueDiff

_DESCRIPTION = """\
Compare two checkpoints tensor by tensor, reading large tensors in row blocks, and value by
value. Lists tensors only in A or only in B, with different shapes or dtypes, or with
different values (with the largest absolute difference |a - b| and relative difference
|a - b| / max(|a|, |b|)), and values that differ. Layouts and world sizes may differ: the
global tensors are compared. Values that differ show where: the first character that
differs, in a window of both texts (...abc[X]def...), and a unified diff of multi-line texts.

examples:
  unickpt diff runs/gpt/step-270 runs/gpt/step-280
  unickpt diff runs/gpt --steps 270 280

exit status: 0 identical, 1 different, 2 error"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``diff`` command."""
    parser = add_command(subparsers, "diff", _DESCRIPTION)
    parser.add_argument("a", metavar="A", help="first checkpoint: " + PATH_HELP)
    parser.add_argument(
        "b", metavar="B", nargs="?", help="second checkpoint, the same way (or --steps)"
    )
    add_step_option(parser, "A or B")
    parser.add_argument(
        "--steps",
        type=int,
        nargs=2,
        metavar=("N", "M"),
        help="compare steps N and M of the Checkpointer root A (no B)",
    )
    parser.add_argument(
        "--atol",
        type=float,
        default=0.0,
        help="tensors whose elements all satisfy |a - b| <= atol + rtol * |b| "
        "count as equal (default: 0, every bit counts)",
    )
    parser.add_argument("--rtol", type=float, default=0.0, help="see --atol (default: 0)")
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="do not check the checksums of the data read (compare damaged checkpoints)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_progress_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import CheckpointError
    from ..tools.diff import diff_checkpoints
    from ..tools.progress import progress_bar, wants_progress

    try:
        with progress_bar("comparing", wants_progress(args.progress)) as progress:
            a, b = _sources(args)
            report = diff_checkpoints(
                a, b, atol=args.atol, rtol=args.rtol, verify=args.verify, progress=progress
            )
    except CheckpointError as e:
        return print_error(e)
    if args.json:
        print(json.dumps({**asdict(report), "identical": report.identical}, indent=2))
    else:
        print(render(report))
    return 0 if report.identical else 1


def _sources(args: argparse.Namespace) -> tuple[Storage, Storage]:
    """The two checkpoints the arguments name: A and B, or steps N and M of root A."""
    from ..errors import CheckpointError

    if args.steps is None and args.b is None:
        raise CheckpointError("diff needs two checkpoints: A B, or a root A with --steps N M.")
    if args.steps is not None:
        if args.b is not None or args.step is not None:
            given = "B" if args.b is not None else "--step"
            raise CheckpointError(
                f"--steps N M compares two steps of root A; {given} was given too. Pass A B "
                "(with --step) or A --steps N M."
            )
        n, m = args.steps
        return open_source(args.a, n), open_source(args.a, m)
    return _open(args.a, args.step), _open(args.b, args.step)


def _open(path: str, step: int | None) -> Storage:
    """``path``'s checkpoint; ``step`` applies when it is a Checkpointer root."""
    from ..format.metadata import COMMIT_FILE
    from ..storage.registry import open_storage

    is_checkpoint = open_storage(path).size(COMMIT_FILE) is not None
    return open_source(path, None if is_checkpoint else step)


def _what(d: TensorDiff) -> str:
    if d.kind == "only_a":
        return "only in A"
    if d.kind == "only_b":
        return "only in B"
    if d.kind == "kind":
        return "tensor in one, value in the other"
    if d.kind == "shape":
        return f"shape {list(d.shape_a or ())} vs {list(d.shape_b or ())}"
    if d.kind == "dtype":
        return f"dtype {d.dtype_a} vs {d.dtype_b}"
    return "values differ"


def _number(x: float | None) -> str:
    return "" if x is None else f"{x:.6g}"


def render(r: DiffReport) -> str:
    from ..tools.table import format_table
    from ..units import format_bytes

    compared = (
        f"{r.tensors_compared} tensors ({format_bytes(r.bytes_compared)}) and "
        f"{r.values_compared} values compared in {r.elapsed_s:.2f} s"
    )
    if r.identical:
        return f"identical: {r.a} and {r.b}: {compared}"
    parts = [f"different: {r.a} (A) and {r.b} (B): {compared}"]
    if r.tensors:
        rows = [
            [
                d.key,
                _what(d),
                _number(d.max_abs),
                _number(d.max_rel),
                "" if d.differing is None else str(d.differing),
            ]
            for d in r.tensors
        ]
        headers = ["tensor", "difference", "max abs", "max rel", "elements"]
        parts.append(format_table(headers, rows, right="234"))
    if r.values:
        names = {"only_a": "only in A", "only_b": "only in B", "values": "differs"}
        rows = [[v.key, names[v.kind], v.a or "", v.b or ""] for v in r.values]
        parts.append(format_table(["value", "difference", "A", "B"], rows))
        parts += [_where(v) for v in r.values if v.offset is not None]
    return "\n\n".join(parts)


def _where(v: ValueDiff) -> str:
    """Where two values differ: a window around the first difference, a unified diff."""
    lines = [
        f"{v.key}: first difference at character {v.offset}:",
        f"  A {v.context_a}",
        f"  B {v.context_b}",
    ]
    if v.unified:
        lines += ["  " + line for line in v.unified.splitlines()]
    return "\n".join(lines)
