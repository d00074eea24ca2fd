"""Reading an incremental checkpoint: its referenced files, served from their step folders.

The assembled metadata of an incremental checkpoint names the files of earlier checkpoints as
``../<step folder>/<data file>`` (:mod:`unickpt.format.references`). :func:`resolving` wraps
the checkpoint's storage so that the read path opens those names like its own files: each one
maps to ``(parent.child(step), data file)``, where ``parent`` is the folder holding the
checkpoint (its Checkpointer root). A referenced step that is missing or uncommitted raises
:class:`CheckpointCorruptError` naming it. Plain names go to the checkpoint's own storage, so
a self-contained checkpoint reads exactly as before. Nothing is written through the wrapper.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

from ..errors import CheckpointCorruptError, CheckpointError
from ..format.codec import decode_metadata
from ..format.metadata import COMMIT_FILE
from ..format.references import FileLocation, parse_reference
from ..storage.base import Storage, StorageView, WriteHandle, check_name
from .commit import read_commit

_STEP_FOLDER = re.compile(r"^step-\d+$")


class ReferencingStorage(StorageView):
    """A checkpoint's storage that also reads the files its references name."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self._steps: dict[str, Storage] = {}
        self._lock = threading.Lock()

    def _route(self, name: str) -> tuple[Storage, str]:
        where = parse_reference(name)
        if where is None:
            return self.inner, name
        return self._step(where), check_name(where.data)

    def _step(self, where: FileLocation) -> Storage:
        with self._lock:
            found = self._steps.get(where.step)
        if found is not None:
            return found
        parent = self.inner.parent()
        if parent is None:
            raise CheckpointError(
                f"{self.inner.location} refers to step folder {where.step} beside it, but its "
                "storage backend cannot open the folder holding it; copy the checkpoint with "
                "`unickpt convert` to a self-contained one, or read it through a local path or URL."
            )
        step = parent.child(check_name(where.step))
        if step.size(COMMIT_FILE) is None:
            raise CheckpointCorruptError(
                f"{self.inner.location} refers to bytes of step folder {where.step} "
                f"({step.location}), which holds no committed checkpoint: the step it depends on "
                "was deleted or its save did not finish. Load an earlier checkpoint."
            )
        with self._lock:
            return self._steps.setdefault(where.step, step)

    def size(self, name: str) -> int | None:
        storage, local = self._route(name)
        return storage.size(local)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        storage, local = self._route(name)
        storage.read_into(local, offset, out)

    def map_range(self, name: str, offset: int, length: int) -> memoryview | None:
        storage, local = self._route(name)
        return storage.map_range(local, offset, length)

    def read_bytes(self, name: str) -> bytes | None:
        storage, local = self._route(name)
        return storage.read_bytes(local)

    def write_atomic(self, name: str, data: bytes) -> None:
        self.inner.write_atomic(check_name(name), data)

    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        return self.inner.create(check_name(name), part_sizes)

    def remove(self, name: str) -> None:
        self.inner.remove(check_name(name))

    def remove_many(self, names: Sequence[str]) -> None:
        self.inner.remove_many([check_name(n) for n in names])

    def close(self) -> None:
        with self._lock:
            steps = list(self._steps.values())
        for s in steps:
            s.close()
        self.inner.close()


def resolving(storage: Storage) -> Storage:
    """``storage`` able to read the files an incremental checkpoint in it refers to."""
    return storage if isinstance(storage, ReferencingStorage) else ReferencingStorage(storage)


def references_of(step: Storage) -> tuple[str, ...]:
    """The step folders the committed checkpoint in ``step`` refers to (its global metadata
    alone is read); empty when no committed checkpoint is there. Raises when the marker or
    the metadata cannot be read: a failed read is no proof that nothing is referred to."""
    record = read_commit(step)
    if record is None:
        return ()
    name = check_name(record.metadata_file)
    raw = step.read_bytes(name)
    if raw is None:
        if read_commit(step) is None:
            return ()  # deleted between the two reads
        raise CheckpointCorruptError(
            f"{step.location} is committed but its metadata file {name} is missing; the "
            "checkpoint is damaged."
        )
    return decode_metadata(raw, f"{step.location}/{record.metadata_file}").references


def needed_steps(root: Storage, kept: Sequence[str]) -> set[str]:
    """The step folders under ``root`` that the checkpoints in ``kept`` refer to, directly or
    through the ones they refer to (so that every step left listed still loads).

    Raises :class:`CheckpointError` when a kept checkpoint's references cannot be read (a
    request failed, or the checkpoint is damaged): whoever deletes on the strength of this
    answer must then delete nothing.
    """
    needed: set[str] = set()
    todo = list(kept)
    seen = set(todo)
    while todo:
        name = todo.pop()
        try:
            refs = references_of(root.child(name))
        except CheckpointError as e:
            raise type(e)(
                f"the references of {root.location}/{name} cannot be read ({e}), so no step "
                "can be proven unreferenced"
            ) from e
        for step in refs:
            needed.add(step)
            if step not in seen:
                seen.add(step)
                todo.append(step)
    return needed


def dependents(storage: Storage) -> list[str]:
    """The sibling folders whose committed checkpoints refer to bytes in ``storage``'s folder
    (checked before a save replaces a committed checkpoint there). Raises when a sibling cannot
    be read: a reference that cannot be ruled out is treated as one."""
    parent = storage.parent()
    if parent is None:
        return []  # references resolve through the parent: none can reach this folder
    own = storage.location.rstrip("/").rsplit("/", 1)[-1]
    found = []
    for sibling in parent.list_names():
        if sibling == own or not _STEP_FOLDER.match(sibling):
            continue  # references name step folders only (a Checkpointer's incremental saves)
        try:
            refs = references_of(parent.child(sibling))
        except CheckpointError as e:
            raise CheckpointError(
                f"replacing the checkpoint in {storage.location}: whether the checkpoint in "
                f"{parent.location}/{sibling} refers to its bytes cannot be read ({e}). Nothing "
                "was written; try again, or remove that folder if it is damaged."
            ) from e
        if own in refs:
            found.append(sibling)
    return found
