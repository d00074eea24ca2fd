"""The storage interface: one checkpoint's files, addressed by plain names.

The engine calls, in order, for a save: ``create`` (one per data file, from the writing rank),
``WriteHandle.write_at`` (from many threads), ``WriteHandle.close`` (flushes to durable media),
then on the coordinating rank ``write_atomic`` for the metadata and last for the commit marker,
``sync`` and ``remove`` for debris. For a load: ``read_atomic``-written names are read with
``read_bytes``; data with ``read_into`` from many threads.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable

from ..errors import CheckpointCorruptError

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,255}$")


def check_name(name: str) -> str:
    """Refuse names that could escape the checkpoint folder (``..``, ``/``, absolute paths)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name or name == ".":
        raise CheckpointCorruptError(
            f"file name {name!r} in the checkpoint is not a plain file name (letters, digits, "
            "'.', '_', '-'); a checkpoint never points outside its folder. It is damaged or "
            "was crafted: do not load it."
        )
    return name


class WriteHandle(ABC):
    """An open data file being written; safe to call ``write_at`` from several threads."""

    @abstractmethod
    def write_at(self, offset: int, data: memoryview) -> None: ...

    @abstractmethod
    def close(self, durable: bool = True) -> None:
        """Close the file; with ``durable`` its bytes are on stable media when this returns."""


class Storage(ABC):
    """The files of one checkpoint."""

    @property
    @abstractmethod
    def location(self) -> str:
        """A human-readable place, for messages."""

    @abstractmethod
    def create(self, name: str, nbytes: int) -> WriteHandle: ...

    @abstractmethod
    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))``; a short file is corrupt."""

    @abstractmethod
    def size(self, name: str) -> int | None:
        """The file's size in bytes, or None when it does not exist."""

    @abstractmethod
    def write_atomic(self, name: str, data: bytes) -> None:
        """Write a whole small file so that readers see the old one or the new one, never half."""

    @abstractmethod
    def read_bytes(self, name: str) -> bytes | None:
        """A whole small file, or None when it does not exist."""

    @abstractmethod
    def list_names(self) -> list[str]: ...

    @abstractmethod
    def remove(self, name: str) -> None: ...

    def acquire_lock(self) -> Callable[[], None]:
        """Take the folder's writer lock; return its release. Backends without locks no-op."""
        return lambda: None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release cached handles."""
