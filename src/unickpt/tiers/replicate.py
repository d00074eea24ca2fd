"""After a memory save commits: the commit on every node, each rank's files on its replica node.

Runs on every rank in the save's background thread, on the tier's own group, so the training
loop stalls only for the local memory save. The coordinator reads its commit marker and
metadata bytes and hands them (or its error) to every rank; the other nodes' leaders write them
(metadata first, marker last). Then each rank sends its data and index files to its replica
ranks (:meth:`Nodes.sends`); a receiver writes the data file, and only once every transfer of
every rank went through, renames the index file into place (the rule that makes a file count as
present). The save is done, on every rank, only once every receiver reports its renames: when
``fut.wait()`` returns, every replica of the step is whole on its node.

Every step a rank takes alone (reading, writing the commit copy, making room for a replica,
sending or receiving a file, renaming) reports its outcome to every rank before the next
collective, so a failure on one rank fails the save on all of them at once, never leaving the
others waiting for the collective timeout. Peak extra memory: the broadcast metadata; the
replica files themselves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..dist import decide, run_step
from ..engine.commit import data_name, read_commit
from ..errors import CheckpointCorruptError
from ..format.codec import decode_metadata
from ..format.metadata import COMMIT_FILE, FileRef
from .group import TierGroup, Transfer
from .memory import MemoryStore, folder_errors
from .nodes import Nodes


@dataclass(frozen=True)
class Committed:
    """A committed memory checkpoint: its marker and metadata bytes, and its files."""

    step: int
    save_id: str
    commit_raw: bytes
    metadata_file: str
    metadata_raw: bytes
    refs: tuple[FileRef, ...]

    @property
    def writers(self) -> list[int]:
        """The ranks that wrote files (their numbers in the saving job)."""
        return [int(r.data.rsplit("-", 1)[1].split(".")[0]) for r in self.refs]

    def ref_of(self, rank: int) -> FileRef | None:
        """The files written by ``rank`` (None when it wrote none)."""
        name = data_name(self.save_id, rank)
        return next((r for r in self.refs if r.data == name), None)


def read_committed(store: MemoryStore, step: int) -> Committed:
    """The commit marker and metadata of a memory step from this node's folder."""
    storage = store.step(step)
    record = read_commit(storage)
    commit_raw = storage.read_bytes(COMMIT_FILE)
    raw = storage.read_bytes(record.metadata_file) if record else None
    if record is None or commit_raw is None or raw is None:
        raise CheckpointCorruptError(
            f"{storage.location} has no complete commit (marker and metadata) although the "
            "save committed; the node's memory folder was changed from outside. Save again."
        )
    meta = decode_metadata(raw, storage.location)
    return Committed(step, record.save_id, commit_raw, record.metadata_file, raw, meta.file_refs)


def share_commit(group: TierGroup, nodes: Nodes, store: MemoryStore, step: int) -> Committed:
    """The coordinator's commit, on every rank and in every node's folder."""
    committed = decide(
        group, f"reading the commit of memory step {step}", lambda: read_committed(store, step)
    )

    def land() -> tuple[None, None]:
        if nodes.is_leader and nodes.node != nodes.node_of(0):
            with folder_errors(f"writing the commit of memory step {step} into {store.root}"):
                write_commit(store, committed)
        return None, None

    if nodes.count > 1:
        run_step(group, f"copying the commit of memory step {step} to every node", land)
    return committed


def write_commit(store: MemoryStore, committed: Committed) -> None:
    storage = store.step(committed.step)
    storage.write_atomic(committed.metadata_file, committed.metadata_raw)
    storage.write_atomic(COMMIT_FILE, committed.commit_raw)


def replicate(
    group: TierGroup, nodes: Nodes, store: MemoryStore, committed: Committed, copies: int
) -> int:
    """Send this rank's files to its replica ranks, receive the files it keeps; bytes sent.
    Returns on every rank once every replica is whole on its node (its index renamed into
    place), or raises on every rank."""
    step = committed.step
    folder = store.step_path(step)
    transfers: list[Transfer] = []
    receives: list[tuple[FileRef, Path]] = []
    for k, (src, dst) in enumerate(nodes.sends(copies)):
        ref = committed.ref_of(src)
        if ref is None or group.rank not in (src, dst):
            continue
        data, index = folder / ref.data, folder / ref.index
        if src == group.rank:
            transfers.append(Transfer(data, ref.nbytes, dst, 2 * k, True))
            transfers.append(Transfer(index, ref.index_nbytes, dst, 2 * k + 1, True))
        else:
            landing = folder / f".{ref.index}.{os.getpid()}.tmp"
            transfers.append(Transfer(data, ref.nbytes, src, 2 * k, False))
            transfers.append(Transfer(landing, ref.index_nbytes, src, 2 * k + 1, False))
            receives.append((ref, landing))

    def make_room() -> tuple[None, None]:
        with folder_errors(f"making room for replicas in {folder}"):
            if receives:
                folder.mkdir(parents=True, exist_ok=True)
            for ref, _ in receives:
                store.take_spare(folder / ref.data, ref.nbytes)
        return None, None

    def move() -> tuple[None, None]:
        group.exchange(transfers)
        return None, None

    def land() -> tuple[None, None]:
        with folder_errors(f"renaming the replicas' indexes into place in {folder}"):
            for ref, landing in receives:  # its data file is whole: present from now on
                os.replace(folder / landing.name, folder / ref.index)
        return None, None

    run_step(group, f"making room for the replicas of memory step {step}", make_room)
    run_step(group, f"sending the replicas of memory step {step}", move)
    run_step(group, f"committing the replicas of memory step {step}", land)
    return sum(t.nbytes for t in transfers if t.send)
