"""``unickpt inspect PATH``: what a checkpoint holds, from its metadata alone."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from .commands import add_command
from .errors import print_error
from .steps import PATH_HELP, add_step_option, open_source

if TYPE_CHECKING:
    from ..tools.inspection import CheckpointSummary, ObjectGroup

_DESCRIPTION = """\
Print the tensors of a checkpoint (key, dtype, global shape, the layout it was saved from,
number of stored shards, bytes stored), the quantized tables with the error quantization made
(largest absolute difference, RMS difference relative to the values' RMS), its Python values
(key, type, short value), with totals, the world size it was saved with, the versions that
wrote it and when. Reads the metadata only; use `unickpt verify` to check the data.

Values equal under keys that differ only in their middle (the learning rate of every
parameter's group: optimizer.param_groups.*.lr) are shown once with their count; --expand
lists every key. --keys and --only select what is shown (and what --json prints).

A Hugging Face safetensors folder or a torch.distributed.checkpoint folder (which
unickpt.load reads as they are) is shown as unickpt reads it.

exit status: 0 shown, 1 a --keys pattern matches no key, 2 no checkpoint (or no such --only
name) or other error

examples:
  unickpt inspect runs/gpt --only model
  unickpt inspect runs/gpt --keys '*.exp_avg' --keys '*.lr'"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``inspect`` command."""
    parser = add_command(subparsers, "inspect", _DESCRIPTION)
    parser.add_argument("path", metavar="PATH", help=PATH_HELP)
    add_step_option(parser)
    parser.add_argument(
        "--keys",
        action="append",
        default=[],
        metavar="PATTERN",
        help="show only keys matching this shell pattern (* also matches dots); repeatable",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="show only this top-level key (model, optimizer, ...); repeatable",
    )
    parser.add_argument(
        "--expand", action="store_true", help="list every value, not repeated ones once"
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import CheckpointError
    from ..tools.inspection import inspect_checkpoint, select_entries, unmatched_patterns

    try:
        summary = inspect_checkpoint(open_source(args.path, args.step), foreign=True)
        selected = select_entries(summary, args.keys, args.only)
    except CheckpointError as e:
        return print_error(e)
    unmatched = unmatched_patterns(summary, args.keys)
    if unmatched:
        shown = ", ".join(repr(p) for p in unmatched)
        print(
            f"error: --keys {shown} matches no key of {summary.path} (* also matches dots: "
            f"'*.lr'); see its keys with `unickpt inspect {args.path}`.",
            file=sys.stderr,
        )
        return 1
    summary = selected
    print(json.dumps(summary.to_dict(), indent=2) if args.json else render(summary, args.expand))
    return 0


def render(s: CheckpointSummary, expand: bool = False) -> str:
    from ..tools.inspection import foreign_format, group_objects
    from ..tools.table import format_table
    from ..units import format_bytes

    producer = ", ".join(f"{k} {v}" for k, v in sorted(s.producer.items())) or "unknown"
    files = f"{len(s.files)} file{'s' if len(s.files) != 1 else ''}"
    foreign = foreign_format(s)
    if foreign is None:
        about = [
            ["saved", f"{s.created_iso} by world size {s.world_size}"],
            ["producer", producer],
            ["format", f"version {s.format_version}, save {s.save_id}"],
            ["checksums", f"{s.checksum_algorithm} per {format_bytes(s.segment_bytes)}"],
        ]
    else:
        about = [
            ["format", f"{_FOREIGN.get(foreign, foreign)}, as unickpt.load reads it"],
            ["checksums", "none (its files are read unverified)"],
        ]
    head = format_table(
        ["checkpoint", s.path],
        [
            *about,
            ["data", f"{files}, {format_bytes(s.data_bytes)}"],
            *([["refers to", ", ".join(s.references)]] if s.references else []),
        ],
    )
    tensor_rows = [
        [t.key, t.dtype, str(list(t.shape)), t.layout, str(t.shards), format_bytes(t.nbytes)]
        for t in s.tensors
    ]
    tensors = format_table(
        ["key", "dtype", "shape", "layout", "shards", "bytes"], tensor_rows, "45"
    )
    quantized = [t for t in s.tensors if t.encoding is not None]
    if quantized:
        tensors += "\n\nquantized tables (loads decode them):\n" + format_table(
            ["key", "encoding", "max abs error", "RMS relative error"],
            [
                [t.key, str(t.encoding), _error(t.max_abs_error), _error(t.rms_relative_error, "%")]
                for t in quantized
            ],
        )
    groups = group_objects(s.objects) if not expand else None
    if groups is None or len(groups) == len(s.objects):
        object_rows = [
            [o.key, o.type + (" (per rank)" if o.per_rank else ""), o.summary] for o in s.objects
        ]
        objects = format_table(["key", "type", "value"], object_rows)
    else:
        group_rows = [
            [g.key, g.type + (" (per rank)" if g.per_rank else ""), g.summary, str(g.count)]
            for g in groups
        ]
        objects = format_table(["key", "type", "value", "keys"], group_rows, "3")
    parts = [
        head,
        f"tensors: {len(s.tensors)}, {format_bytes(s.tensor_bytes)}",
        tensors if s.tensors else "(none)",
        f"values: {len(s.objects)}{_distinct(groups, len(s.objects))}",
        objects if s.objects else "(none)",
    ]
    return "\n\n".join([parts[0], "\n".join(parts[1:3]), "\n".join(parts[3:5])])


_FOREIGN = {"safetensors": "Hugging Face safetensors", "dcp": "torch.distributed.checkpoint"}


def _distinct(groups: list[ObjectGroup] | None, count: int) -> str:
    return f" ({len(groups)} distinct, see --expand)" if groups and len(groups) < count else ""


def _error(value: float | None, unit: str = "") -> str:
    if value is None:
        return "unknown"
    return f"{value:.3%}" if unit == "%" else f"{value:.4g}"
