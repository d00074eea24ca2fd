"""Conversions between unickpt checkpoints and other formats, by format name."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import CheckpointError
from ..storage.base import Storage
from .from_dcp import import_dcp
from .from_deepspeed import import_deepspeed
from .from_megatron import import_megatron
from .from_safetensors import import_safetensors
from .from_torch import import_torch
from .output import nothing_left_on_failure
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
    allow_pickle: bool = False  # imports from torch, dcp, megatron and deepspeed
    overwrite: bool = False
    verify: bool = True  # exports: check the source's checksums while reading
    untie: bool = False  # export to safetensors: write every name of tied tensors
    progress: ProgressFn | None = None


def export_checkpoint(
    src: str | os.PathLike[str] | Storage,
    dst: str | os.PathLike[str],
    fmt: str,
    options: ConvertOptions,
) -> ConvertReport:
    """Export unickpt checkpoint ``src`` (any path or URL) to local ``dst`` in format ``fmt``
    (see :data:`FORMATS`). A failed export leaves nothing at ``dst``."""
    if fmt not in FORMATS:
        raise _unknown(fmt)
    o = options
    with nothing_left_on_failure(dst):
        if fmt == "safetensors":
            return export_safetensors(
                src,
                dst,
                only=o.only,
                max_shard_bytes=o.max_shard_bytes,
                overwrite=o.overwrite,
                verify=o.verify,
                untie=o.untie,
                progress=o.progress,
            )
        exporter = export_torch if fmt == "torch" else export_dcp
        return exporter(
            src, dst, only=o.only, overwrite=o.overwrite, verify=o.verify, progress=o.progress
        )


def import_checkpoint(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], fmt: str, options: ConvertOptions
) -> ConvertReport:
    """Import ``src`` in format ``fmt`` into a new unickpt checkpoint at ``dst`` (any path or
    URL). A failed import leaves nothing at ``dst``."""
    if fmt not in IMPORT_FORMATS:
        raise _unknown(fmt, IMPORT_FORMATS)
    o = options
    importers = {
        "torch": import_torch,
        "dcp": import_dcp,
        "megatron": import_megatron,
        "deepspeed": import_deepspeed,
    }
    with nothing_left_on_failure(dst):
        if fmt == "safetensors":
            return import_safetensors(
                src, dst, prefix=o.prefix, overwrite=o.overwrite, progress=o.progress
            )
        return importers[fmt](
            src,
            dst,
            prefix=o.prefix,
            allow_pickle=o.allow_pickle,
            overwrite=o.overwrite,
            progress=o.progress,
        )


def _unknown(fmt: str, known: tuple[str, ...] = FORMATS) -> CheckpointError:
    return CheckpointError(f"format {fmt!r} is not known; expected one of {', '.join(known)}.")
