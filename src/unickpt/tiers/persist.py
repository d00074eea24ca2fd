"""Copying a memory checkpoint to storage, with no collective: any subset of ranks may do it.

Each rank uploads the files it is given (its own, and on the way down the replicas it keeps
for ranks whose files storage lacks) through the storage backend's part-based writes: the data
file first, then its index. Whoever then sees every index file of the checkpoint in storage
writes the metadata and the commit marker, copied byte for byte from the memory checkpoint, so
two ranks finishing together write the same bytes. A rank never waits for another: the
protocol works with dead peers, outside any collective, from a signal handler.

Peak extra memory: none of our own (parts are memory-mapped views of the tmpfs files); the
backend's upload buffers.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..engine.commit import LOCK_FILE, read_commit, remove_debris
from ..errors import CheckpointError
from ..format.metadata import COMMIT_FILE
from ..root.names import step_name
from ..storage.base import Storage
from .memory import MemoryStore
from .replicate import Committed

PART_BYTES = 64 << 20


def persisted(root: Storage, committed: Committed) -> bool:
    """Whether storage holds this very checkpoint (same step, same save), committed."""
    try:
        record = read_commit(root.child(step_name(committed.step)))
    except Exception:  # noqa: BLE001 - a damaged marker is as good as none: persist again
        return False
    return record is not None and record.save_id == committed.save_id


def persist(
    store: MemoryStore, committed: Committed, root: Storage, ranks: list[int], threads: int = 4
) -> bool:
    """Upload the files of ``ranks`` that storage lacks and this node holds; commit when all
    are there. Returns whether storage now holds the checkpoint committed."""
    if persisted(root, committed):
        return True
    try:
        return _persist(store, committed, root, ranks, threads)
    except CheckpointError:
        # Ranks persist without a collective: another one may have committed this checkpoint
        # meanwhile and cleared the temporary files of this rank's writes as debris.
        if persisted(root, committed):
            return True
        raise


def _persist(
    store: MemoryStore, committed: Committed, root: Storage, ranks: list[int], threads: int
) -> bool:
    target = root.child(step_name(committed.step))
    folder = store.step_path(committed.step)
    for rank in ranks:
        ref = committed.ref_of(rank)
        if ref is None or target.size(ref.index) == ref.index_nbytes:
            continue
        index = folder / ref.index
        if not index.is_file():
            continue
        upload(folder / ref.data, ref.nbytes, target, ref.data, threads)
        target.write_atomic(ref.index, index.read_bytes())
    if any(target.size(r.index) is None for r in committed.refs):
        return False
    target.write_atomic(committed.metadata_file, committed.metadata_raw)
    target.write_atomic(COMMIT_FILE, committed.commit_raw)
    keep = {COMMIT_FILE, LOCK_FILE, committed.metadata_file}
    keep |= {n for r in committed.refs for n in (r.data, r.index)}
    remove_debris(target, keep)
    return True


def part_sizes(nbytes: int, storage: Storage) -> list[int]:
    """Parts of about ``PART_BYTES`` within the backend's minimum and maximum size and count."""
    size = max(PART_BYTES, storage.min_part_bytes, 1)
    if storage.max_parts:
        size = max(size, -(-nbytes // storage.max_parts))
    if storage.max_part_bytes is not None and size > storage.max_part_bytes:
        raise CheckpointError(
            f"a data file of {nbytes:,} bytes does not fit in {storage.max_parts} parts of at "
            f"most {storage.max_part_bytes:,} bytes (the storage backend's limits); save with "
            "more ranks."
        )
    count = max(1, -(-nbytes // size))
    return [size] * (count - 1) + [nbytes - size * (count - 1)]


def upload(path: Path, nbytes: int, target: Storage, name: str, threads: int) -> None:
    """One data file from a node folder into storage, parts in parallel, from a memory map."""
    sizes = part_sizes(nbytes, target)
    handle = target.create(name, sizes)
    try:
        with _view(path, nbytes) as view:
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]

            def write(i: int) -> None:
                handle.write_part(i, [view[offsets[i] : offsets[i] + sizes[i]]])

            if len(sizes) == 1:
                write(0)
            else:
                with ThreadPoolExecutor(min(threads, len(sizes))) as pool:
                    list(pool.map(write, range(len(sizes))))
        handle.complete()
    except BaseException:
        handle.abort()
        raise


@contextlib.contextmanager
def _view(path: Path, nbytes: int) -> Iterator[memoryview]:
    if nbytes == 0:
        yield memoryview(b"")
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ)
        view = memoryview(mm)
        try:
            yield view
        finally:
            view.release()
            mm.close()
    finally:
        os.close(fd)
