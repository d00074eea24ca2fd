"""References: chunks of a checkpoint whose bytes lie in an earlier checkpoint's data file.

An incremental checkpoint (format version 2) stores only the chunks that changed; each other
chunk refers to the data file of an earlier checkpoint under the same root, named by the step
folder and the file name (never a path): ``(step-000000100, data-3f2a9c1b7d04-00000.bin)``.
Readers resolve the step folder against the folder holding the checkpoint. In the assembled
metadata such a file appears in ``Metadata.files`` as ``../step-000000100/data-…bin``, a name
that reads as the right relative path in messages and that storage alone cannot open (a
reference-aware storage, :mod:`unickpt.engine.references`, maps it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import CheckpointCorruptError

_PREFIX = "../"


@dataclass(frozen=True, order=True)
class FileLocation:
    """Data file ``data`` of the checkpoint in step folder ``step`` (a sibling folder)."""

    step: str
    data: str

    @property
    def name(self) -> str:
        """The file's name in the assembled metadata: ``../<step>/<data>``."""
        return f"{_PREFIX}{self.step}/{self.data}"


def parse_reference(name: str) -> FileLocation | None:
    """The location a ``../<step>/<data>`` name stands for; None for a plain file name."""
    if not name.startswith(_PREFIX):
        return None
    step, sep, data = name[len(_PREFIX) :].partition("/")
    if not sep or not step or not data or "/" in data:
        raise CheckpointCorruptError(
            f"file name {name!r} in the checkpoint is neither a plain file name nor a reference "
            "'../<step folder>/<data file>'; it is damaged or was crafted: do not load it."
        )
    return FileLocation(step, data)


class FileTable:
    """The numbering of the files chunks lie in: a checkpoint's own files first, then each
    referenced file once, numbered as the indexes name them (safe from several threads)."""

    def __init__(self, own: Sequence[str]) -> None:
        self._names = list(own)
        self._numbers = {n: i for i, n in enumerate(own)}
        self._lock = threading.Lock()

    def number(self, location: FileLocation) -> int:
        name = location.name
        with self._lock:
            found = self._numbers.get(name)
            if found is None:
                found = self._numbers[name] = len(self._names)
                self._names.append(name)
            return found

    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._names)
