"""Writing exports safely: whole files appear at once, and nothing is overwritten unasked."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError, CheckpointExistsError

log = logging.getLogger(__name__)


def check_distinct(src: Path, dst: Path) -> None:
    if src.resolve() == dst.resolve():
        raise CheckpointError(
            f"source and destination are both {src}; write the conversion to another path."
        )


@contextmanager
def atomic_file(dst: Path, overwrite: bool) -> Iterator[Path]:
    """A scratch path next to ``dst``; it replaces ``dst`` when the block finishes cleanly."""
    if dst.is_dir():
        raise CheckpointError(f"{dst} is a folder; expected the path of a file to write.")
    if dst.exists() and not overwrite:
        raise CheckpointExistsError(
            f"{dst} already exists; pass --overwrite (overwrite=True) to replace it, or choose "
            "another destination."
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_folder(dst: Path, existing: Iterable[Path], overwrite: bool, what: str) -> list[Path]:
    """Create ``dst``; refuse if it holds files of an earlier export (``existing``) unless
    ``overwrite``. Returns those files, for the caller to remove once its output is complete."""
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst} is a file; expected a folder to write the {what} into.")
    found = sorted(p for p in existing if p.exists())
    if found and not overwrite:
        names = ", ".join(p.name for p in found[:5])
        raise CheckpointExistsError(
            f"{dst} already holds a {what} ({names}); pass --overwrite (overwrite=True) to "
            "replace it, or choose another destination."
        )
    dst.mkdir(parents=True, exist_ok=True)
    return found


def remove_files(paths: Iterable[Path]) -> None:
    for p in paths:
        log.debug("removing %s", p)
        p.unlink(missing_ok=True)
