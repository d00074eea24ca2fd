"""A root's identity: where it resolves to, plus an id written at its first save.

Two jobs that both call their root ``"ckpt"`` from different folders, or a job restarted
after its root was deleted, are different roots; the string a user typed is not a name. A
root's identity is its resolved location (an absolute, symlink-free path for local folders;
the URL for others) and the random id in its ``ROOT_ID`` file, written once, by the first save
into the root. The memory tier names a job's folder of memory checkpoints by it, so it never
restores from, or deletes, another root's memory checkpoints.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass

from ..errors import CheckpointCorruptError
from ..storage.base import Storage
from ..storage.registry import is_local

ROOT_ID_FILE = "ROOT_ID"
_KIND = "unickpt-root"


@dataclass(frozen=True)
class RootIdentity:
    """Which root this is: its resolved location and the id written at its first save."""

    location: str
    root_id: str

    @property
    def key(self) -> str:
        return f"{self.location}#{self.root_id}"


def resolved_location(storage: Storage) -> str:
    """The root's location with relative paths and symbolic links resolved."""
    location = storage.location
    if is_local(location):
        return os.path.realpath(os.path.abspath(location))
    return location.rstrip("/")


def read_root_id(storage: Storage) -> str | None:
    """The root's id, or None when no save has written one yet; raises when it cannot be
    read (a failed read is not an absent id)."""
    raw = storage.read_bytes(ROOT_ID_FILE)
    if raw is None:
        return None
    where = f"{storage.location}/{ROOT_ID_FILE}"
    try:
        doc = json.loads(raw.decode("utf-8"))
        root_id = doc["id"] if isinstance(doc, dict) and doc.get("kind") == _KIND else None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorruptError(
            f"{where} is not a unickpt root id file ({e}); it was damaged. Restore it from a "
            "backup, or delete it to give the root a new identity (its memory checkpoints are "
            "then no longer found)."
        ) from e
    if not isinstance(root_id, str) or not root_id.isalnum() or len(root_id) > 64:
        raise CheckpointCorruptError(
            f"{where} holds no valid root id (found {raw[:80]!r}); expected a JSON object with "
            f'"kind": "{_KIND}" and an alphanumeric "id". Restore it, or delete it to give the '
            "root a new identity."
        )
    return root_id


def ensure_root_id(storage: Storage) -> str:
    """The root's id, written now when the root has none (by its writer, under its lock)."""
    found = read_root_id(storage)
    if found is not None:
        return found
    doc = {"kind": _KIND, "id": uuid.uuid4().hex, "created_unix_s": round(time.time(), 3)}
    storage.write_atomic(ROOT_ID_FILE, json.dumps(doc).encode("utf-8"))
    written = read_root_id(storage)
    if written is None:
        raise CheckpointCorruptError(
            f"{storage.location}/{ROOT_ID_FILE} was written and then not found: the storage "
            "does not read its own writes. Check the storage backend."
        )
    return written
