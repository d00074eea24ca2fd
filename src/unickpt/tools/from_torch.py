"""Import a ``torch.save`` file into a unickpt checkpoint, keeping its nested structure."""

from __future__ import annotations

import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, CheckpointNotFoundError
from .imports import save_imported, with_prefix
from .output import check_distinct
from .progress import ProgressFn
from .reports import ConvertReport

log = logging.getLogger(__name__)


def import_torch(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    allow_pickle: bool = False,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> ConvertReport:
    """Save the dict in ``torch.save`` file ``src`` as unickpt checkpoint ``dst``.

    The file is read with ``torch.load(weights_only=True)`` (any pickled object only with
    ``allow_pickle=True``, which then also stores such objects with pickle) and memory-mapped
    when it is in the zip format, so tensors are paged in while they are written. The
    checkpoint's keys are the dotted paths of the dict, so ``unickpt.load(dst, state)`` fills a
    state of the same structure; ``prefix`` puts everything under one key.

    >>> import_torch("model.pt", "ckpt/imported", prefix="model")  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    src_path = Path(src)
    check_distinct(src_path, dst)
    state = with_prefix(load_torch_file(src_path, allow_pickle), prefix, src_path)
    return save_imported(
        state,
        src_path,
        dst,
        "torch",
        allow_pickle=allow_pickle,
        overwrite=overwrite,
        started_s=t0,
        progress=progress,
    )


def load_torch_file(path: Path, allow_pickle: bool) -> Any:
    """``torch.load`` of ``path`` onto the CPU, memory-mapped when the format allows it."""
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"{path} is not a file; expected a file written by torch.save."
        )
    _check_kind(path)
    try:
        try:
            return _load(path, allow_pickle, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            log.info("%s is in the legacy torch.save format; reading it into memory", path)
            return _load(path, allow_pickle, mmap=False)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if allow_pickle:
            raise CheckpointError(
                f"{path} could not be unpickled ({first}); expected a file written by torch.save."
            ) from e
        raise CheckpointError(
            f"{path} holds objects that torch.load(weights_only=True) refuses ({first}). If you "
            "trust the file, pass --allow-pickle (allow_pickle=True)."
        ) from e
    except (RuntimeError, EOFError, ValueError, KeyError) as e:
        raise CheckpointError(
            f"{path} could not be read by torch.load ({e}); expected a file written by torch.save."
        ) from e


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default format: a zip archive
_PICKLE_PROTOCOL = 0x80  # the first byte of a pickle (protocol 2+): torch.save's legacy format


def _check_kind(path: Path) -> None:
    """Raise when ``path`` is neither a zip archive nor a pickle, the two formats torch.save
    writes, saying what the file starts with."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(_ZIP_MAGIC) or head[:1] == bytes([_PICKLE_PROTOCOL]):
        return
    found = "it is empty" if not head else f"it starts with {head!r}"
    raise CheckpointError(
        f"{path} is not a torch.save file ({found}); expected a zip archive or a pickle, "
        "the formats torch.save writes. Check the path, or pick the --from format that "
        "matches the file."
    )


def _load(path: Path, allow_pickle: bool, mmap: bool) -> Any:
    return torch.load(path, map_location="cpu", weights_only=not allow_pickle, mmap=mmap)
