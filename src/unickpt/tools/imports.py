"""What the importers share: wrapping under a prefix, saving with unickpt, reporting."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..api import save
from ..engine.tensor_reader import CheckpointReader
from ..errors import CheckpointError, UnsafeObjectError
from .progress import ProgressFn
from .reports import ConvertReport


def with_prefix(state: Any, prefix: str | None, source: Path) -> dict[str, Any]:
    """``{prefix: state}`` when a prefix is given; otherwise ``state``, which must be a dict."""
    if prefix:
        return {prefix.rstrip("."): state}
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{source} holds a {type(state).__name__}, expected a dict of named entries; pass "
            "--prefix NAME (prefix=...) to store it under one key."
        )
    return state


def save_imported(
    state: dict[str, Any],
    src: Path,
    dst: str | os.PathLike[str],
    fmt: str,
    *,
    allow_pickle: bool,
    overwrite: bool,
    started_s: float,
    progress: ProgressFn | None = None,
) -> ConvertReport:
    """Save ``state`` as a unickpt checkpoint at ``dst`` and describe the result."""
    try:
        save(dst, state, allow_pickle=allow_pickle, overwrite=overwrite, progress=progress)
    except UnsafeObjectError as e:
        hint = " From the command line: --allow-pickle, if you trust the source."
        hint = "" if allow_pickle else hint
        raise UnsafeObjectError(f"{src}: {e}{hint}") from e
    with CheckpointReader(dst) as reader:
        meta = reader.metadata
        files = tuple(f"{reader.storage.location}/{f}" for f in meta.files)
        values = len(meta.objects) + len(meta.per_rank)
        return ConvertReport(
            str(src),
            str(dst),
            fmt,
            files,
            len(meta.tensors),
            values,
            meta.total_bytes,
            (),
            time.perf_counter() - started_s,
        )
