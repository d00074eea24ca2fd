"""Writing exports safely: whole files appear at once, and nothing is overwritten unasked."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError, CheckpointExistsError
from ..storage.base import Storage
from ..storage.registry import is_local, local_path, open_storage

log = logging.getLogger(__name__)

Location = str | os.PathLike[str] | Storage


def check_distinct(src: Location, dst: Location) -> None:
    """Refuse a conversion whose source and destination are one place."""
    if _place(src) == _place(dst):
        raise CheckpointError(
            f"source and destination are both {_text(src)}; write the conversion to another path."
        )


@contextmanager
def nothing_left_on_failure(dst: Location) -> Iterator[None]:
    """When the block fails, remove what it created at ``dst``: the files and folders that were
    not there before, and the folders made for it (a local path's missing parents; a URL's
    folder when it held nothing, which on object stores is the same as not existing)."""
    storage = open_storage(dst)
    before = set(storage.list_names())
    new_root = _first_missing(Path(local_path(_text(dst)))) if is_local(dst) else None
    try:
        yield
    except BaseException:
        try:
            if new_root is not None:
                _remove_path(new_root)
            elif not before and not is_local(dst):
                parent, _, name = storage.location.rstrip("/").rpartition("/")
                open_storage(parent).remove_tree(name)
            else:
                for name in sorted(set(storage.list_names()) - before):
                    storage.remove(name)
                    storage.remove_tree(name)
        except CheckpointError as e:
            log.warning("could not remove what a failed conversion left at %s (%s)", dst, e)
        raise


def _first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist yet, if any."""
    missing = None
    path = path.absolute()
    while not path.exists() and not path.is_symlink() and path != path.parent:
        missing, path = path, path.parent
    return missing


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _text(location: Location) -> str:
    return location.location if isinstance(location, Storage) else os.fspath(location)


def _place(location: Location) -> str:
    text = _text(location)
    return str(Path(local_path(text)).resolve()) if is_local(location) else text.rstrip("/")


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
