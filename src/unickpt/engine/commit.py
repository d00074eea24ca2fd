"""The commit protocol: data first and durable, then metadata, then the commit marker.

A folder holds a checkpoint only once its ``COMMIT`` marker exists; the marker names the
metadata file and pins its size and checksum, and is replaced atomically (a rename on file
systems, a single PUT on object stores), so a crash at any instant leaves either the previous
checkpoint or the new one, never a mix. Everything goes through the folder's
:class:`~unickpt.storage.base.Storage`: reading, writing, listing and removing debris.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..format.codec import (
    assemble,
    decode_commit,
    decode_index,
    decode_metadata,
    encode_commit,
    encode_metadata,
)
from ..format.metadata import COMMIT_FILE, ChunkMeta, CommitRecord, FileRef, Metadata
from ..format.references import FileTable
from ..storage.base import Storage, check_name
from .checksum import digest

log = logging.getLogger(__name__)

LOCK_FILE = "LOCK"
_OURS = re.compile(r"^(metadata-[0-9a-f]+\.json|(data|index)-[0-9a-f]+-\d+\.(bin|json)|\..*\.tmp)$")


def metadata_name(save_id: str) -> str:
    return f"metadata-{save_id}.json"


def data_name(save_id: str, rank: int) -> str:
    return f"data-{save_id}-{rank:05d}.bin"


def index_name(save_id: str, rank: int) -> str:
    return f"index-{save_id}-{rank:05d}.json"


def read_commit(storage: Storage) -> CommitRecord | None:
    raw = storage.read_bytes(COMMIT_FILE)
    if raw is None:
        return None
    where = f"{storage.location}/{COMMIT_FILE}"
    record = decode_commit(raw, where)
    check_name(record.metadata_file)  # a name that leaves the folder says so first
    if record.metadata_file != metadata_name(record.save_id):
        raise CheckpointCorruptError(
            f"{where} names save {record.save_id!r} but metadata file {record.metadata_file!r} "
            f"(a save's metadata is {metadata_name(record.save_id)!r}); the commit marker is "
            "damaged. Load an earlier checkpoint."
        )
    return record


def read_checkpoint(storage: Storage) -> tuple[CommitRecord, Metadata]:
    """The commit marker and metadata of a committed checkpoint, both checked, with every
    tensor's chunks from every index."""
    record, meta = read_metadata(storage)
    files = FileTable(meta.files)
    with ThreadPoolExecutor(8, thread_name_prefix="unickpt-index") as pool:
        indexes = list(
            pool.map(
                lambda i: _read_index(storage, meta.file_refs[i], i, files),
                range(len(meta.files)),
            )
        )
    return record, replace(assemble(meta, indexes), files=files.names())


def read_metadata(storage: Storage) -> tuple[CommitRecord, Metadata]:
    """The commit marker and metadata of a committed checkpoint, both checked; tensors without
    chunks (:func:`read_checkpoint` adds every chunk, :mod:`.indexes` those a load needs)."""
    record = read_commit(storage)
    if record is None:
        raise CheckpointNotFoundError(_not_found_message(storage))
    name = check_name(record.metadata_file)
    raw = storage.read_bytes(name)
    where = f"{storage.location}/{name}"
    if raw is None:
        raise CheckpointCorruptError(
            f"{where} is missing but the commit marker names it; the checkpoint is damaged. "
            "Load an earlier checkpoint."
        )
    if len(raw) != record.metadata_nbytes or digest(memoryview(raw)) != record.metadata_checksum:
        raise CheckpointCorruptError(
            f"{where} has {len(raw)} bytes with checksum {digest(memoryview(raw))}, but the "
            f"commit marker expects {record.metadata_nbytes} bytes with checksum "
            f"{record.metadata_checksum}; the metadata is damaged. Load an earlier checkpoint."
        )
    meta = decode_metadata(raw, where)
    for ref in meta.file_refs:
        check_name(ref.data)
        check_name(ref.index)
    return record, meta


def _read_index(
    storage: Storage, ref: FileRef, file: int, files: FileTable
) -> list[tuple[str, ChunkMeta]]:
    raw = read_index_bytes(storage, ref)
    return decode_index(raw, f"{storage.location}/{ref.index}", file, files)


def read_index_bytes(storage: Storage, ref: FileRef) -> bytes:
    """The bytes of ``ref``'s index file, checked against the size and checksum the metadata
    gives."""
    where = f"{storage.location}/{ref.index}"
    raw = storage.read_bytes(ref.index)
    if raw is None:
        raise CheckpointCorruptError(
            f"{where} is missing but the metadata names it; the checkpoint is damaged. "
            "Load an earlier checkpoint."
        )
    found = digest(memoryview(raw))
    if len(raw) != ref.index_nbytes or found != ref.index_checksum:
        raise CheckpointCorruptError(
            f"{where} has {len(raw)} bytes with checksum {found}, but the metadata expects "
            f"{ref.index_nbytes} bytes with checksum {ref.index_checksum}; the index is damaged. "
            "Load an earlier checkpoint."
        )
    return raw


def _not_found_message(storage: Storage) -> str:
    if storage.is_file():
        return (
            f"{storage.location} is a file, not a unickpt checkpoint (checkpoints are folders "
            "with a COMMIT file); pass the checkpoint's folder."
        )
    names = storage.list_names()
    if not names:
        return (
            f"no checkpoint at {storage.location}: the folder is missing or empty. Check the "
            "path (unickpt checkpoints are folders with a COMMIT file)."
        )
    if any(_OURS.match(n) for n in names):
        return (
            f"{storage.location} holds an incomplete save (data files but no {COMMIT_FILE} "
            "marker): the save that wrote it did not finish. Load an earlier checkpoint."
        )
    return (
        f"{storage.location} is not a unickpt checkpoint: it has no {COMMIT_FILE} marker "
        f"(found {', '.join(names[:5])}{'...' if len(names) > 5 else ''})."
    )


def commit(storage: Storage, meta: Metadata, save_id: str) -> None:
    """Write the metadata, then the marker; then remove files no checkpoint needs any more."""
    raw = encode_metadata(meta)
    name = metadata_name(save_id)
    storage.write_atomic(name, raw)
    record = CommitRecord(name, len(raw), digest(memoryview(raw)), save_id)
    try:
        storage.write_atomic(COMMIT_FILE, encode_commit(record))
    except CheckpointError:
        if not _committed(storage, save_id):  # else: the marker landed, its answer was lost
            raise
    keep = {COMMIT_FILE, name, LOCK_FILE, *meta.files, *(r.index for r in meta.file_refs)}
    try:
        remove_debris(storage, keep)
        storage.remove_temporary_files()  # every rank's files are complete: none is live
    except CheckpointError as e:  # committed: what is left, the next save removes
        log.warning("%s; the checkpoint is committed, the next save removes the rest", e)


def _committed(storage: Storage, save_id: str) -> bool:
    """Whether the marker in ``storage`` is this save's (False when it cannot be read)."""
    try:
        record = read_commit(storage)
    except CheckpointError:
        return False
    return record is not None and record.save_id == save_id


def remove_debris(storage: Storage, keep: set[str]) -> None:
    """Delete files an interrupted or replaced save left behind (only unickpt's own names),
    all in one call (object stores delete them in one request per 1,000)."""
    names = [n for n in storage.list_names() if n not in keep and _OURS.match(n)]
    if names:
        log.debug("removing %s from %s", ", ".join(names), storage.location)
        storage.remove_many(names)
