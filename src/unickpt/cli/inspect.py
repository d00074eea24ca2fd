"""``unickpt inspect PATH``: what a checkpoint holds, from its metadata alone."""

from __future__ import annotations

import argparse
import json
import sys

from ..checkpointer import open_checkpoint
from ..errors import CheckpointError
from ..tools.inspection import CheckpointSummary, inspect_checkpoint
from ..tools.table import format_table
from ..tools.units import format_bytes
from .steps import PATH_HELP, add_step_option

_DESCRIPTION = """\
Print the tensors of a checkpoint (key, dtype, global shape, the layout it was saved from,
number of stored shards, bytes stored), the quantized tables with the error quantization made
(largest absolute difference, RMS difference relative to the values' RMS), its Python values
(key, type, short value), with totals, the world size it was saved with, the versions that
wrote it and when. Reads the metadata only; use `unickpt verify` to check the data."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``inspect`` command."""
    parser = subparsers.add_parser(
        "inspect",
        help="list the tensors and values of a checkpoint",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", help=PATH_HELP)
    add_step_option(parser)
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        summary = inspect_checkpoint(open_checkpoint(args.path, args.step))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary.to_dict(), indent=2) if args.json else render(summary))
    return 0


def render(s: CheckpointSummary) -> str:
    producer = ", ".join(f"{k} {v}" for k, v in sorted(s.producer.items())) or "unknown"
    files = f"{len(s.files)} file{'s' if len(s.files) != 1 else ''}"
    head = format_table(
        ["checkpoint", s.path],
        [
            ["saved", f"{s.created_iso} by world size {s.world_size}"],
            ["producer", producer],
            ["format", f"version {s.format_version}, save {s.save_id}"],
            ["checksums", f"{s.checksum_algorithm} per {format_bytes(s.segment_bytes)}"],
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
    object_rows = [
        [o.key, o.type + (" (per rank)" if o.per_rank else ""), o.summary] for o in s.objects
    ]
    objects = format_table(["key", "type", "value"], object_rows)
    parts = [
        head,
        f"tensors: {len(s.tensors)}, {format_bytes(s.tensor_bytes)}",
        tensors if s.tensors else "(none)",
        f"values: {len(s.objects)}",
        objects if s.objects else "(none)",
    ]
    return "\n\n".join([parts[0], "\n".join(parts[1:3]), "\n".join(parts[3:5])])


def _error(value: float | None, unit: str = "") -> str:
    if value is None:
        return "unknown"
    return f"{value:.3%}" if unit == "%" else f"{value:.4g}"
