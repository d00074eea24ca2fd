"""Conversions between unickpt checkpoints and other formats, by format name."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import CheckpointError
from .from_dcp import import_dcp
from .from_deepspeed import import_deepspeed
from .from_megatron import import_megatron
from .from_safetensors import import_safetensors
from .from_torch import import_torch
from .progress import ProgressFn
from .reports import ConvertReport
from .to_dcp import export_dcp
from .to_safetensors import DEFAULT_MAX_SHARD_BYTES, export_safetensors
from .to_torch import export_torch

FORMATS = ("safetensors", "torch", "dcp")
IMPORT_FORMATS = (*FORMATS, "megatron", "deepspeed")


@dataclass(frozen=True)
class ConvertOptions:
    """Settings of a conversion; each applies to the directions its comment names."""

    only: str | None = None  # exports: the subtree to write, prefix removed
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES  # export to safetensors
    prefix: str | None = None  # imports: put everything under this key
    allow_pickle: bool = False  # imports from torch and dcp
    overwrite: bool = False
    progress: ProgressFn | None = None


def export_checkpoint(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], fmt: str, options: ConvertOptions
) -> ConvertReport:
    """Export unickpt checkpoint ``src`` to ``dst`` in format ``fmt`` (see :data:`FORMATS`)."""
    o = options
    if fmt == "safetensors":
        return export_safetensors(
            src,
            dst,
            only=o.only,
            max_shard_bytes=o.max_shard_bytes,
            overwrite=o.overwrite,
            progress=o.progress,
        )
    if fmt == "torch":
        return export_torch(src, dst, only=o.only, overwrite=o.overwrite, progress=o.progress)
    if fmt == "dcp":
        return export_dcp(src, dst, only=o.only, overwrite=o.overwrite, progress=o.progress)
    raise _unknown(fmt)


def import_checkpoint(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], fmt: str, options: ConvertOptions
) -> ConvertReport:
    """Import ``src`` in format ``fmt`` into a new unickpt checkpoint at ``dst``."""
    o = options
    if fmt == "safetensors":
        return import_safetensors(
            src, dst, prefix=o.prefix, overwrite=o.overwrite, progress=o.progress
        )
    importers = {
        "torch": import_torch,
        "dcp": import_dcp,
        "megatron": import_megatron,
        "deepspeed": import_deepspeed,
    }
    if fmt in importers:
        return importers[fmt](
            src,
            dst,
            prefix=o.prefix,
            allow_pickle=o.allow_pickle,
            overwrite=o.overwrite,
            progress=o.progress,
        )
    raise _unknown(fmt, IMPORT_FORMATS)


def _unknown(fmt: str, known: tuple[str, ...] = FORMATS) -> CheckpointError:
    return CheckpointError(f"format {fmt!r} is not known; expected one of {', '.join(known)}.")
