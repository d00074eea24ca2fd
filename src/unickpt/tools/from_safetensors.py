"""Import safetensors (one file, or a folder of shards with an index) into a unickpt checkpoint.

Tensors are memory-mapped by ``safetensors.safe_open`` and paged in while they are written.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .imports import save_imported, with_prefix
from .output import check_distinct
from .progress import ProgressFn
from .reports import ConvertReport

log = logging.getLogger(__name__)


def import_safetensors(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> ConvertReport:
    """Save the tensors of safetensors ``src`` as unickpt checkpoint ``dst``.

    ``src`` is a ``.safetensors`` file, or a folder with a ``*.safetensors.index.json`` (or a
    single ``.safetensors`` file). Dotted names become the checkpoint's keys, so
    ``unickpt.load(dst, {"model": model})`` works with ``prefix="model"``.

    >>> import_safetensors("hf-model/", "ckpt/imported", prefix="model")  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    src_path = Path(src)
    check_distinct(src_path, dst)
    with ExitStack() as stack:
        tensors: dict[str, torch.Tensor] = {}
        for file in safetensors_files(src_path):
            handle = stack.enter_context(_open(file))
            for key in handle.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                if key in tensors:
                    raise CheckpointCorruptError(
                        f"'{key}' is in more than one file of {src_path}; expected each tensor "
                        "in exactly one shard."
                    )
                tensors[key] = handle.get_tensor(key)
        state = with_prefix(tensors, prefix, src_path)
        return save_imported(
            state,
            src_path,
            dst,
            "safetensors",
            allow_pickle=False,
            overwrite=overwrite,
            started_s=t0,
            progress=progress,
        )


def safetensors_files(src: Path) -> list[Path]:
    """The files of a safetensors file or folder, as its index lists them."""
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise CheckpointNotFoundError(
            f"{src} does not exist; expected a .safetensors file or folder."
        )
    indexes = sorted(src.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(
            f"{src} has several index files ({', '.join(p.name for p in indexes)}); pass the "
            "path of one .safetensors file, or a folder with a single index."
        )
    if indexes:
        return _indexed_files(indexes[0])
    files = sorted(src.glob("*.safetensors"))
    if len(files) != 1:
        raise CheckpointNotFoundError(
            f"{src} has {len(files)} .safetensors files and no *.safetensors.index.json; expected "
            "one file, or shards with an index."
        )
    return files


def _indexed_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointCorruptError(
            f"{index} is not a safetensors index (JSON with a weight_map): {e}."
        ) from e
    files = [index.parent / str(n) for n in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointNotFoundError(
            f"{index.name} names {', '.join(missing[:5])}, which {index.parent} lacks; the "
            "download or copy is incomplete."
        )
    return files


def _open(file: Path) -> Any:
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as e:
        raise CheckpointError(
            "reading safetensors needs the safetensors package: pip install safetensors"
        ) from e
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise CheckpointCorruptError(
            f"{file} is not a readable safetensors file ({e}); the file is damaged or is "
            "another format."
        ) from e
