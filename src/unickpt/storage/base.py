"""The storage interface: a folder of named files, wherever it lives.

A :class:`Storage` addresses one folder: a checkpoint, or a Checkpointer root holding step
folders (reached with :meth:`Storage.child`). It sees names, byte ranges and buffers; it knows
nothing of tensors. Backends are chosen by URL scheme (:mod:`unickpt.storage.registry`).

Who calls what, in order, for a save of one checkpoint folder:

1. the coordinating rank: :meth:`~Storage.acquire_lock` (only writers lock; readers never do);
2. every writing rank, once per data file: :meth:`~Storage.create` with the sizes of the
   file's parts, then :meth:`WriteHandle.write_part` from the engine's threads (several at
   once, any order, parts handed out in index order), then :meth:`WriteHandle.complete`, or
   :meth:`WriteHandle.abort` on failure (possibly while other parts are still in flight);
   or, where the parts' sizes are learnt only as they come (compressed saves), once per data
   file :meth:`~Storage.create_stream`, then :meth:`StreamHandle.append` of its bytes in file
   order, then :meth:`StreamHandle.complete`, or :meth:`StreamHandle.abort` on failure;
3. every writing rank: :meth:`~Storage.write_atomic` for its index file;
4. the coordinating rank: ``write_atomic`` of the metadata, then of ``COMMIT`` (last), then
   :meth:`~Storage.list_names` and :meth:`~Storage.remove` for files no checkpoint needs; then
   the lock's release (a Checkpointer holds its root's lock across saves and checks before
   each save that it still holds it).

For a load, every rank calls :meth:`~Storage.read_bytes` (commit marker, metadata, indexes),
:meth:`~Storage.size`, then :meth:`~Storage.read_into` from many threads at once. A
Checkpointer lists its root, reads each step folder's marker, and deletes old steps with
:meth:`~Storage.remove` (the marker first) and :meth:`~Storage.remove_tree`.

What every backend guarantees:

- **Small files are atomic**: a reader of a ``write_atomic`` file sees the old content or the
  new, never a part (a rename on file systems; a single PUT on object stores).
- **Completed data is durable** when ``complete`` returns on backends that can promise it
  (local: fsync of the file; ``write_atomic`` also fsyncs the folder). Backends that cannot
  (fsspec) say so in their docstring and in docs/storage.md.
- **Listings are read after writes**: a name written (or removed) before a listing starts is
  (or is not) in it. Folders appear in ``list_names`` of their parent; on object stores a
  folder exists once it holds an object.
- **A data file is all or nothing**: until ``complete`` returns, nothing of it is under its
  name (file systems write it under a temporary name, see :func:`temp_name`, and rename it in
  ``complete``; object stores show it when its upload completes); after ``abort`` nothing of
  it is left at all. A writer killed mid-file leaves only a temporary file, which no listing
  shows; the next writer's lock of the folder removes it, and so does the removal of a step
  folder as a whole.
"""

from __future__ import annotations

import re
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from ..errors import CheckpointCorruptError, CheckpointError


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class HeldLock:
    """A writer lock this process holds: calling it releases it; :attr:`check` raises
    :class:`~unickpt.errors.CheckpointLockedError` naming the other writer once the lock is
    no longer this holder's (taken over, or its lock file replaced), so that the holder stops
    saving instead of writing beside another job."""

    release: Callable[[], None]
    check: Callable[[], None] = _nothing  # backends that cannot tell

    def __call__(self) -> None:
        self.release()


_NAME = re.compile(r"^[A-Za-z0-9._-]{1,255}$")
_TEMP = re.compile(r"^\..+\.([0-9a-f]{12}\.part|[0-9a-f]{8}\.tmp)$")


def temp_name(name: str, small: bool = False) -> str:
    """A fresh temporary name in the same folder for file ``name`` while it is written:
    ``.<name>.<12 hex>.part`` for a data file, ``.<name>.<8 hex>.tmp`` for a small one."""
    tag = uuid.uuid4().hex
    return f".{name}.{tag[:8]}.tmp" if small else f".{name}.{tag[:12]}.part"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one of :func:`temp_name`'s (listings leave them out)."""
    return _TEMP.fullmatch(name) is not None


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
    """One data file being written as numbered parts that tile it exactly.

    Part ``i`` holds bytes ``[offsets[i], offsets[i] + part_sizes[i])``. Every part but the last
    has at least the backend's ``min_part_bytes``; there are at most ``max_parts``. The engine
    calls :meth:`write_part` once per part, from several threads at once, handing parts out in
    index order (so a backend that must write in order may make a later part wait for earlier
    ones without deadlock); then :meth:`complete` once, from one thread, after every
    ``write_part`` returned. On failure it calls :meth:`abort`, possibly while other
    ``write_part`` calls are in flight: those return promptly (raising), and the backend's
    :meth:`_discard` runs once the last of them has.

    Backends implement :meth:`_write_part`, :meth:`_complete` and :meth:`_discard`.
    """

    def __init__(self, location: str, part_sizes: Sequence[int], min_part_bytes: int) -> None:
        if not part_sizes or any(n < 0 for n in part_sizes):
            raise AssertionError(f"{location}: bad part sizes {list(part_sizes)[:8]}")
        if any(n < min_part_bytes for n in part_sizes[:-1]):
            raise AssertionError(f"{location}: a part below {min_part_bytes} bytes")
        self.location = location
        self.part_sizes = tuple(part_sizes)
        self.offsets = (0, *accumulate(self.part_sizes))[:-1]
        self.nbytes = sum(self.part_sizes)
        self._cond = threading.Condition()
        self._active = 0
        self._aborted = False

    @property
    def aborted(self) -> bool:
        return self._aborted

    def write_part(self, index: int, buffers: Sequence[memoryview]) -> None:
        """Write part ``index``: ``buffers`` in order make its bytes (valid during the call)."""
        given = sum(b.nbytes for b in buffers)
        if given != self.part_sizes[index]:
            raise AssertionError(f"{self.location}: part {index} got {given} bytes")
        with self._cond:
            if self._aborted:
                raise CheckpointError(f"writing {self.location} was aborted.")
            self._active += 1
        try:
            self._write_part(index, [_as_bytes(b) for b in buffers])
        finally:
            with self._cond:
                self._active -= 1
                last = self._aborted and self._active == 0
                self._cond.notify_all()
            if last:
                self._discard()

    def complete(self) -> None:
        """Make the file durable and visible under its name (all parts written)."""
        try:
            self._complete()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Give up the file: nothing of it stays. Idempotent; safe with writes in flight."""
        with self._cond:
            if self._aborted:
                return
            self._aborted = True
            idle = self._active == 0
            self._cond.notify_all()
        if idle:
            self._discard()

    @abstractmethod
    def _write_part(self, index: int, buffers: list[memoryview]) -> None: ...

    @abstractmethod
    def _complete(self) -> None:
        """Finish the file; on failure raise with the file still discardable."""

    @abstractmethod
    def _discard(self) -> None:
        """Remove whatever was written; called once, with no ``_write_part`` in flight."""


class StreamHandle(ABC):
    """One data file written front to back, its bytes handed over as they are made.

    The engine calls :meth:`append` with the file's bytes in order (any number of buffers of
    any size per call) and then :meth:`complete`, both from one thread; on failure
    :meth:`abort` (idempotent; from any thread). The same promises hold as for a
    :class:`WriteHandle`: nothing is under the file's name until :meth:`complete` returns,
    the file is then durable where the backend can promise it, and nothing of it is left after
    :meth:`abort`. Backends cut the bytes into the parts they need (S3: at least 5 MiB but the
    last), so a caller's buffers are only valid during the call that hands them over.
    """

    def __init__(self, location: str) -> None:
        self.location = location
        self.nbytes = 0
        """The bytes appended so far."""
        self._aborted = False

    @property
    def aborted(self) -> bool:
        return self._aborted

    def append(self, buffers: Sequence[memoryview]) -> None:
        """Write ``buffers`` after the bytes appended before (valid during the call)."""
        if self._aborted:
            raise CheckpointError(f"writing {self.location} was aborted.")
        views = [_as_bytes(b) for b in buffers if b.nbytes]
        if views:
            self._append(views)
            self.nbytes += sum(v.nbytes for v in views)

    def complete(self) -> None:
        """Make the file durable and visible under its name (every byte appended)."""
        if self._aborted:
            raise CheckpointError(f"writing {self.location} was aborted.")
        try:
            self._complete()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Give up the file: nothing of it stays. Idempotent."""
        if self._aborted:
            return
        self._aborted = True
        self._discard()

    @abstractmethod
    def _append(self, buffers: list[memoryview]) -> None: ...

    @abstractmethod
    def _complete(self) -> None:
        """Finish the file; on failure raise with the file still discardable."""

    @abstractmethod
    def _discard(self) -> None:
        """Remove whatever was written (and stop whatever is in flight)."""


class BufferedStream(StreamHandle):
    """A stream for backends without one of their own: the bytes are held in memory, then
    written through :meth:`Storage.create` as parts the backend takes when completed."""

    def __init__(self, storage: Storage, name: str) -> None:
        super().__init__(f"{storage.location}/{name}")
        self._storage, self._name = storage, name
        self._held: list[bytes] = []

    def _append(self, buffers: list[memoryview]) -> None:
        self._held.append(b"".join(buffers))

    def _complete(self) -> None:
        data = memoryview(b"".join(self._held))
        self._held = []
        sizes = stream_part_sizes(len(data), self._storage)
        handle = self._storage.create(self._name, sizes)
        try:
            at = 0
            for index, n in enumerate(sizes):
                handle.write_part(index, [data[at : at + n]])
                at += n
        except BaseException:
            handle.abort()
            raise
        handle.complete()

    def _discard(self) -> None:
        self._held = []


STREAM_PART_BYTES = 16 << 20
"""The part size a stream aims at (raised to the backend's ``min_part_bytes``)."""


def stream_part_sizes(nbytes: int, storage: Storage) -> list[int]:
    """Parts of ``nbytes`` that ``storage`` takes: :data:`STREAM_PART_BYTES` each (or what the
    backend's minimum, maximum and part count ask for), the last one shorter."""
    size = max(STREAM_PART_BYTES, storage.min_part_bytes, 1)
    if storage.max_parts:
        size = max(size, -(-nbytes // storage.max_parts))
    if storage.max_part_bytes:
        size = min(size, storage.max_part_bytes)
    sizes = [size] * (nbytes // size)
    return [*sizes, nbytes - len(sizes) * size] if nbytes % size or not sizes else sizes


def _as_bytes(buf: memoryview) -> memoryview:
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")


class Storage(ABC):
    """A folder of named files. Thread-safe: the engine calls it from many threads."""

    min_part_bytes: int = 0
    """The smallest part a data file may be cut into, except its last (object stores: 5 MiB)."""

    max_parts: int | None = None
    """The most parts a data file may have (S3: 10,000); parts grow to stay within it."""

    maps_files: bool = False
    """Whether :meth:`map_range` can map files (local file systems: through the page cache)."""

    max_part_bytes: int | None = None
    """The largest part a data file may have (S3: 5 GiB); large chunks are cut to fit."""

    cheap_reads: bool = False
    """A read costs little more than its copy (local files): a verified read goes one checksum
    segment at a time, each checked while it is still in the processor's cache."""

    in_memory: bool = False
    """The files live in memory (a tmpfs such as ``/dev/shm``): reading them is a memory copy,
    so loads copy out of maps of them (:meth:`map_range`) rather than read them."""

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the folder is, as a path or URL that :func:`open_storage` opens again."""

    @abstractmethod
    def child(self, name: str) -> Storage:
        """The sub-folder ``name`` (created when something is written into it)."""

    @abstractmethod
    def list_names(self) -> list[str]:
        """Names of the files and sub-folders, sorted; empty when the folder does not exist."""

    @abstractmethod
    def size(self, name: str) -> int | None:
        """The file's size in bytes, or None when no such file exists."""

    @abstractmethod
    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))``; a short file is corrupt."""

    @abstractmethod
    def read_bytes(self, name: str) -> bytes | None:
        """A whole small file, or None when it does not exist."""

    @abstractmethod
    def write_atomic(self, name: str, data: bytes) -> None:
        """Write a whole small file so that readers see the old one or the new one, never half."""

    @abstractmethod
    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        """Start writing data file ``name`` as parts of these sizes (see :class:`WriteHandle`)."""

    def create_stream(self, name: str) -> StreamHandle:
        """Start writing data file ``name`` front to back, its size learnt as it comes (see
        :class:`StreamHandle`). Here the bytes are held in memory and written through
        :meth:`create` when completed; backends that can write as the bytes come override it."""
        return BufferedStream(self, name)

    def streams_through_create(self, base: type[Storage]) -> bool:
        """Whether a subclass of backend ``base`` changes how :meth:`create` writes: its
        streams then go through its :meth:`create` (:class:`BufferedStream`), not ``base``'s
        own stream."""
        return type(self).create is not base.create

    @abstractmethod
    def remove(self, name: str) -> None:
        """Delete file ``name``; a missing file is no error."""

    def remove_many(self, names: Sequence[str]) -> None:
        """Delete files ``names``; missing ones are no error. One by one here; backends with
        a batch delete override it (S3: one request per 1,000 files)."""
        for name in names:
            self.remove(name)

    @abstractmethod
    def remove_tree(self, name: str) -> None:
        """Delete sub-folder ``name`` and everything in it; a missing one is no error."""

    def map_range(self, name: str, offset: int, length: int) -> memoryview | None:
        """Bytes ``[offset, offset + length)`` of file ``name`` mapped into memory without a copy
        (writes to the view are private to this process and never reach the file), or None when
        the backend cannot map or the file is shorter. The mapping lives as long as the view."""
        return None

    def parent(self) -> Storage | None:
        """The folder holding this one, or None when the backend cannot name it.

        Readers of incremental checkpoints reach the step folders a checkpoint refers to as
        ``parent().child(step)``: a checkpoint in a Checkpointer root refers to its siblings.
        """
        return None

    def acquire_lock(self) -> HeldLock:
        """Take the folder's writer lock; return it held (calling it releases it).

        Raises :class:`~unickpt.errors.CheckpointLockedError` naming the holder when another
        writer has it. Only writers lock; readers work beside a writer. Backends that cannot
        lock return a no-op lock (and say so in their docstring).
        """
        return HeldLock(_nothing)

    def remove_temporary_files(self) -> None:  # noqa: B027 - optional hook
        """Delete the temporary files of writers that did not finish (:func:`temp_name`).
        Called where no writer of the folder is live: under its lock, or at a commit (every
        rank's files are complete by then). Backends without temporary files do nothing."""

    def is_file(self) -> bool:
        """Whether the location is a plain file rather than a folder (for error messages)."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release cached handles; the storage stays usable."""


class StorageView(Storage):
    """A storage that stands for ``inner``: every call goes to ``inner`` unless a subclass
    changes it (a load's view that adds files or routes names elsewhere). Its streams go
    through its own :meth:`create` (:class:`BufferedStream`), so a subclass's ``create`` holds
    for them too."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.min_part_bytes = inner.min_part_bytes
        self.max_parts = inner.max_parts
        self.maps_files = inner.maps_files
        self.max_part_bytes = inner.max_part_bytes
        self.cheap_reads = inner.cheap_reads
        self.in_memory = inner.in_memory

    @property
    def location(self) -> str:
        return self.inner.location

    def child(self, name: str) -> Storage:
        return self.inner.child(name)

    def parent(self) -> Storage | None:
        return self.inner.parent()

    def list_names(self) -> list[str]:
        return self.inner.list_names()

    def size(self, name: str) -> int | None:
        return self.inner.size(name)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(name, offset, out)

    def map_range(self, name: str, offset: int, length: int) -> memoryview | None:
        return self.inner.map_range(name, offset, length)

    def read_bytes(self, name: str) -> bytes | None:
        return self.inner.read_bytes(name)

    def write_atomic(self, name: str, data: bytes) -> None:
        self.inner.write_atomic(name, data)

    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        return self.inner.create(name, part_sizes)

    def remove(self, name: str) -> None:
        self.inner.remove(name)

    def remove_many(self, names: Sequence[str]) -> None:
        self.inner.remove_many(names)

    def remove_tree(self, name: str) -> None:
        self.inner.remove_tree(name)

    def acquire_lock(self) -> HeldLock:
        return self.inner.acquire_lock()

    def remove_temporary_files(self) -> None:
        self.inner.remove_temporary_files()

    def is_file(self) -> bool:
        return self.inner.is_file()

    def close(self) -> None:
        self.inner.close()
