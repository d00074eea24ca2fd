"""``unickpt convert SRC DST --to FORMAT | --from FORMAT``: export or import a checkpoint."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .commands import add_command, add_progress_option
from .errors import print_error
from .steps import add_step_option, open_source

if TYPE_CHECKING:
    from ..tools.reports import ConvertReport

# As unickpt.tools.convert names them (kept here so that --help imports no torch).
FORMATS = ("safetensors", "torch", "dcp")
IMPORT_FORMATS = (*FORMATS, "megatron", "deepspeed")

_DESCRIPTION = """\
Export a unickpt checkpoint to another format (--to), consolidated into whole tensors, or
import one into a new unickpt checkpoint (--from). Exports stream each tensor in bounded
blocks; imports memory-map the source (DCP: a scratch copy), so memory stays near the
largest tensor.

--to safetensors    DST is a folder (model.safetensors, or above --max-shard-size Hugging
                    Face shards model-0000i-of-0000n.safetensors with
                    model.safetensors.index.json), or a file ending in .safetensors. Dotted
                    keys (model.layers.0.weight); Python values are left out. A tied
                    tensor (lm_head.weight sharing model.embed_tokens.weight) is
                    written once, as save_pretrained does; --untie writes every key.
--to torch          DST is one torch.save file of a nested dict ({"model": {...}, "step":
                    7}) that torch.load(weights_only=True) reads.
--to dcp            DST is a torch.distributed.checkpoint folder; dcp.load reads it in one
                    process into a state with the same keys.
--only NAME         exports only the subtree NAME, with the "NAME." prefix removed, ready
                    for model.load_state_dict.
SRC of an export is a checkpoint or a Checkpointer root (its newest committed step, or
--step N), at a path or any URL (s3://, memory://, ...); --no-verify skips its checksums.

--from torch        SRC is a torch.save file holding a dict (read with weights_only=True).
--from safetensors  SRC is a .safetensors file, or a folder with an index JSON.
--from dcp          SRC is a torch.distributed.checkpoint folder.
--from megatron     SRC is a Megatron-Core dist_checkpointing folder (torch_dist backend);
                    its common.pt usually needs --allow-pickle (the arguments Namespace).
--from deepspeed    SRC is a DeepSpeed ZeRO checkpoint (stage 1-3: the save folder with
                    'latest', or a tag folder) or a ds_to_universal folder; DeepSpeed's
                    files need --allow-pickle. The result holds model (fp32 master weights)
                    and optimizer (keyed by parameter name), ready for any layout.
The new checkpoint keeps the source's structure, so unickpt.load(DST, state) fills a state
shaped like the source; --prefix NAME puts everything under NAME. DST may be a URL.
A conversion that fails leaves nothing at DST.

examples:
  unickpt convert ckpt/step-1000 hf-model --to safetensors --only model --max-shard-size 2GB
  unickpt convert runs/gpt model.pt --to torch --only model        # newest step of a root
  unickpt convert model.pt ckpt/imported --from torch --prefix model"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``convert`` command."""
    parser = add_command(subparsers, "convert", _DESCRIPTION)
    parser.add_argument(
        "src",
        metavar="SRC",
        help="what to convert; for --to, a checkpoint or a Checkpointer root (path or URL)",
    )
    parser.add_argument(
        "dst",
        metavar="DST",
        help="where to write the result (for --from, a path or URL); nothing stays on failure",
    )
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=FORMATS, help="export unickpt checkpoint SRC")
    direction.add_argument(
        "--from",
        dest="from_",
        choices=IMPORT_FORMATS,
        metavar="{safetensors,torch,dcp,megatron,deepspeed}",
        help="import SRC into a new unickpt checkpoint",
    )
    parser.add_argument("--only", metavar="NAME", help="export only this subtree, prefix removed")
    parser.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="safetensors shard limit, e.g. 5GB (default), 500MB, 2GiB",
    )
    parser.add_argument(
        "--untie",
        action="store_true",
        help="--to safetensors: write every name of a tied tensor, each with its own copy",
    )
    parser.add_argument("--prefix", metavar="NAME", help="import everything under this key")
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="import objects that need pickle (only from sources you trust)",
    )
    add_step_option(parser, "SRC (--to)")
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="exports: do not check the source's checksums while reading it",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    add_progress_option(parser)
    parser.set_defaults(func=run)


def _misused(args: argparse.Namespace) -> str | None:
    """The first option that does not apply to the chosen direction and format, if any."""
    if args.to:
        if args.prefix or args.allow_pickle:
            return "--prefix and --allow-pickle apply to imports (--from)"
        for flag, given in (("--max-shard-size", args.max_shard_size), ("--untie", args.untie)):
            if given and args.to != "safetensors":
                return f"{flag} applies to --to safetensors"
    else:
        if args.only or args.max_shard_size or args.step is not None or not args.verify:
            return "--only, --max-shard-size, --step and --no-verify apply to exports (--to)"
        if args.untie:
            return "--untie applies to --to safetensors"
        if args.allow_pickle and args.from_ == "safetensors":
            return "--allow-pickle applies to --from torch, dcp, megatron and deepspeed"
    return None


def run(args: argparse.Namespace) -> int:
    from ..errors import CheckpointError
    from ..tools.convert import ConvertOptions, export_checkpoint, import_checkpoint
    from ..tools.progress import progress_bar, wants_progress
    from ..tools.to_safetensors import DEFAULT_MAX_SHARD_BYTES
    from ..units import parse_size

    misuse = _misused(args)
    if misuse:
        print(f"error: {misuse}; see unickpt convert --help.", file=sys.stderr)
        return 2
    fmt = args.to or args.from_
    verb = "exporting" if args.to else "importing"
    try:
        shard = parse_size(args.max_shard_size) if args.max_shard_size else DEFAULT_MAX_SHARD_BYTES
        with progress_bar(f"{verb} ({fmt})", wants_progress(args.progress)) as progress:
            options = ConvertOptions(
                only=args.only,
                max_shard_bytes=shard,
                prefix=args.prefix,
                allow_pickle=args.allow_pickle,
                overwrite=args.overwrite,
                verify=args.verify,
                untie=args.untie,
                progress=progress,
            )
            if args.to:
                source = open_source(args.src, args.step)
                report = export_checkpoint(source, args.dst, fmt, options)
            else:
                report = import_checkpoint(args.src, args.dst, fmt, options)
    except CheckpointError as e:
        return print_error(e)
    print(render(report, exported=bool(args.to)))
    return 0


def render(r: ConvertReport, exported: bool) -> str:
    from ..units import format_bytes

    target = r.format if exported else "unickpt"
    files = f"{len(r.files)} file{'s' if len(r.files) != 1 else ''}"
    line = (
        f"wrote {r.destination} ({target}, {files}): {r.tensors} tensors, {r.values} values, "
        f"{format_bytes(r.tensor_bytes)} in {r.elapsed_s:.2f} s"
    )
    if r.left_out:
        line += f"; left out {len(r.left_out)} (listed in the warning above)"
    tied = [
        f"left out tied {name} (same storage as {kept}); pass --untie to write every key"
        for name, kept in r.tied
    ]
    return "\n".join([line, *tied])
