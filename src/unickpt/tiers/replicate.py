"""After a memory save commits: the commit on every node, each rank's files on its replica node.

Runs on every rank in the save's background thread, on the tier's own group, so the training
loop stalls only for the local memory save. The coordinator's commit marker and metadata bytes
are broadcast and the other nodes' leaders write them (metadata first, marker last). Then each
rank sends its data and index files to its replica ranks (:meth:`Nodes.sends`); a receiver
writes the data file, and only once it is whole, the index file (the rule that makes a file
count as present). Peak extra memory: the broadcast metadata; the replica files themselves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..engine.commit import data_name, read_commit
from ..errors import CheckpointCorruptError
from ..format.codec import decode_metadata
from ..format.metadata import COMMIT_FILE, FileRef
from .group import TierGroup, Transfer
from .memory import MemoryStore
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
    if nodes.count == 1:
        return read_committed(store, step)
    mine = read_committed(store, step) if group.rank == 0 else None
    committed = group.broadcast(mine)
    assert committed is not None
    if nodes.is_leader and nodes.node != nodes.node_of(0):
        write_commit(store, committed)
    return committed


def write_commit(store: MemoryStore, committed: Committed) -> None:
    storage = store.step(committed.step)
    storage.write_atomic(committed.metadata_file, committed.metadata_raw)
    storage.write_atomic(COMMIT_FILE, committed.commit_raw)


def replicate(
    group: TierGroup, nodes: Nodes, store: MemoryStore, committed: Committed, copies: int
) -> int:
    """Send this rank's files to its replica ranks, receive the files it keeps; bytes sent."""
    folder = store.step_path(committed.step)
    transfers: list[Transfer] = []
    renames: list[tuple[str, str]] = []
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
            store.take_spare(data, ref.nbytes)
            transfers.append(Transfer(data, ref.nbytes, src, 2 * k, False))
            transfers.append(Transfer(landing, ref.index_nbytes, src, 2 * k + 1, False))
            renames.append((landing.name, ref.index))
    folder.mkdir(parents=True, exist_ok=True)
    group.exchange(transfers)
    for tmp, final in renames:  # data files are whole: their indexes make them present
        os.replace(folder / tmp, folder / final)
    return sum(t.nbytes for t in transfers if t.send)
