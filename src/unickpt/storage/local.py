"""A folder on a local (or network-mounted) file system: ``pwritev``, ``preadv``, ``fsync``."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import mmap
import os
import shutil
import socket
import stat
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointLockedError
from .base import (
    HeldLock,
    Storage,
    StreamHandle,
    WriteHandle,
    check_name,
    is_temp_name,
    temp_name,
)

log = logging.getLogger(__name__)

_IOV_MAX = 1024
_HUGE = 2 * 1024 * 1024  # a multiple of every allocation granularity Linux has
_MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})
_fs_types: dict[int, str] = {}  # device number -> file system type, read once per device


def _os_error(e: OSError, what: str) -> CheckpointError:
    return os_error(
        e,
        what,
        full="the disk is full: free space or save elsewhere; an earlier committed checkpoint, "
        "if any, is untouched.",
        unwritable="the folder is not writable: fix its permissions or save elsewhere.",
        other="check the path and the file system.",
    )


def os_error(e: OSError, what: str, *, full: str, unwritable: str, other: str) -> CheckpointError:
    """An OSError as a CheckpointError saying what failed and what to do: ``full`` for a
    full device, ``unwritable`` for a folder that cannot be written, ``other`` otherwise."""
    if e.errno == errno.ENOSPC:
        hint = full
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = unwritable
    else:
        hint = other
    where = f" ({e.filename})" if e.filename else ""
    return CheckpointError(f"{what} failed: {e.strerror or e}{where}; {hint}")


def _holder_of(record: bytes) -> str:
    """Who a ``LOCK`` file names (its first line), for messages."""
    return record.decode(errors="replace").split("\n", 1)[0].strip() or "another process"


def _check_lock(path: Path, fd: int, record: bytes) -> None:
    """Raise CheckpointLockedError unless ``path`` is still the file locked through ``fd``
    and holds this holder's ``record``."""
    what = f"checking the lock {path}"
    try:
        mine = os.fstat(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            why, holder = "it was deleted", "nobody"
        else:
            found = path.read_bytes()
            if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                why, holder = "the file was replaced", _holder_of(found)
            elif found != record:
                why, holder = "another writer wrote its name into it", _holder_of(found)
            else:
                return
    except OSError as e:
        raise _os_error(e, what) from e
    raise CheckpointLockedError(
        f"{path.parent}: this writer ({_holder_of(record)}) no longer holds its lock: {why} "
        f"(now held by {holder}). Another job may be saving into the same place, and this "
        "one stops saving there rather than write beside it (or let its retention delete the "
        "other's checkpoints). Stop one of the jobs, or give it another path, and restart it."
    )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_folder(path: Path) -> None:
    """Create ``path`` and missing parents, each new folder's parent fsynced (so it persists)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            if not folder.is_dir():
                raise
            continue
        fsync_dir(folder.parent)


EARLY_WRITEBACK = True
"""Each part of a data file is handed to the disk as soon as it is in the page cache
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait), so the disk writes while
later parts are copied and hashed and the final ``fsync`` finds little left: on a quiet 2-core
machine the durable save of the 100M benchmark went from 1.13-1.22 s to 0.72-0.76 s, under the
raw write+fsync of the same bytes (benchmarks/save_timeline.py, docs/benchmarks.md). Set it to
False to leave the writeback to the kernel until the ``fsync``."""

_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to the disk,
    without waiting (Linux; elsewhere, or where the file system refuses, nothing happens: the
    final ``fsync`` writes everything anyway)."""
    fn = _sync_file_range() if EARLY_WRITEBACK and nbytes > 0 else None
    if fn is not None:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def pwritev_all(fd: int, buffers: Sequence[memoryview], offset: int) -> None:
    """Write ``buffers`` one after another at ``offset`` (short writes continued)."""
    views = [b for b in buffers if b.nbytes]
    i = 0
    while i < len(views):
        n = os.pwritev(fd, views[i : i + _IOV_MAX], offset)
        offset += n
        while i < len(views) and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if n:
            views[i] = views[i][n:]


def fs_type(path: Path) -> str:
    """The type of the file system holding ``path`` (or, when it does not exist yet, its
    nearest existing parent) as ``/proc/self/mountinfo`` names it; "" when unknown."""
    for p in (path, *path.absolute().parents):
        try:
            dev = os.stat(p).st_dev
            break
        except FileNotFoundError:
            continue
        except OSError:
            return ""
    else:
        return ""
    if dev not in _fs_types:
        _fs_types[dev] = _mounted_type(dev)
    return _fs_types[dev]


def _mounted_type(dev: int) -> str:
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        fields = line.split(" - ", 1)
        if len(fields) == 2 and fields[0].split()[2:3] == [want]:
            return fields[1].split()[0] if fields[1].split() else ""
    return ""


class _TempFile:
    """A file written under a temporary name beside ``_path`` through descriptor ``_fd``; on
    completion fsynced, renamed onto its name and the folder fsynced; discarded: removed."""

    _path: Path
    _temp: Path
    _fd: int
    _renamed: bool

    def _complete(self) -> None:
        try:
            os.fsync(self._fd)
            self._close()
            os.replace(self._temp, self._path)
            self._renamed = True
            fsync_dir(self._path.parent)
        except OSError as e:
            raise _os_error(e, f"flushing {self._path}") from e

    def _close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _discard(self) -> None:
        with contextlib.suppress(OSError):
            self._close()
        with contextlib.suppress(OSError):
            (self._path if self._renamed else self._temp).unlink(missing_ok=True)


class LocalWriteHandle(_TempFile, WriteHandle):
    """A data file written under a temporary name in its folder (:func:`temp_name`) through
    one descriptor, parts with ``pwritev`` from many threads at once; on completion fsynced,
    renamed onto its name and the folder fsynced. Until then nothing is under its name.

    ``overwrite``: an existing file at ``path`` (a spare whose pages are reused) is moved to
    the temporary name and written over in place; every byte of the new file is written, so
    nothing of the old one remains readable.
    """

    def __init__(self, path: Path, part_sizes: Sequence[int], overwrite: bool = False) -> None:
        super().__init__(str(path), part_sizes, 0)
        self._path = path
        self._temp = path.with_name(temp_name(path.name))
        self._fd = -1
        self._renamed = False
        try:
            reused = overwrite and _move(path, self._temp)
            flags = os.O_WRONLY | os.O_CREAT | (0 if reused else os.O_EXCL)
            self._fd = os.open(self._temp, flags, 0o644)
            if self.nbytes > 0 or reused:
                os.ftruncate(self._fd, self.nbytes)
        except OSError as e:
            self._discard()
            raise _os_error(e, f"creating {path}") from e

    def _write_part(self, index: int, buffers: list[memoryview]) -> None:
        try:
            pwritev_all(self._fd, buffers, self.offsets[index])
        except OSError as e:
            raise _os_error(e, f"writing {self._path}") from e
        start_writeback(self._fd, self.offsets[index], self.part_sizes[index])


class LocalStreamHandle(_TempFile, StreamHandle):
    """A data file written front to back under a temporary name (:func:`temp_name`); on
    completion fsynced, renamed onto its name and the folder fsynced, as
    :class:`LocalWriteHandle` does."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self._path = path
        self._temp = path.with_name(temp_name(path.name))
        self._renamed = False
        try:
            self._fd = os.open(self._temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise _os_error(e, f"creating {path}") from e

    def _append(self, buffers: list[memoryview]) -> None:
        try:
            pwritev_all(self._fd, buffers, self.nbytes)
        except OSError as e:
            raise _os_error(e, f"writing {self._path}") from e


def _move(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst``; False when there is no ``src``."""
    try:
        os.replace(src, dst)
    except FileNotFoundError:
        return False
    return True


class LocalStorage(Storage):
    """Files in one folder, created (parents fsynced) on first write; names never escape it.

    Data files are written under a temporary name with ``pwritev`` (parts from many threads
    at once), fsynced on completion and renamed onto their name; small files go to a temporary
    name too, are fsynced and renamed over the old one; the folder is fsynced after each
    rename. Listings never show temporary names. The lock is ``flock`` on ``LOCK``, released
    by the kernel when the holder dies; taking it removes the temporary files a killed writer
    left in the folder.
    """

    maps_files = True
    cheap_reads = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.root = Path(path)
        self.in_memory = fs_type(self.root) in _MEMORY_FILE_SYSTEMS
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._made = False

    @property
    def location(self) -> str:
        return str(self.root)

    def _path(self, name: str) -> Path:
        return self.root / check_name(name)

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(self._path(name))

    def parent(self) -> LocalStorage:
        root = self.root if self.root.name else self.root.absolute()
        return LocalStorage(root.parent)

    def ensure_root(self) -> None:
        if self._made:
            return
        try:
            make_folder(self.root)
        except OSError as e:
            raise _os_error(e, f"creating the folder {self.root}") from e
        self._made = True

    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        self.ensure_root()
        return LocalWriteHandle(self._path(name), part_sizes)

    def create_stream(self, name: str) -> StreamHandle:
        """A :class:`LocalStreamHandle` (a subclass whose :meth:`create` differs streams
        through it instead)."""
        if self.streams_through_create(LocalStorage):
            return super().create_stream(name)
        self.ensure_root()
        return LocalStreamHandle(self._path(name))

    def _reader_fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                try:
                    fd = os.open(self._path(name), os.O_RDONLY)
                except FileNotFoundError:
                    raise CheckpointCorruptError(
                        f"{self._path(name)} is missing, but the checkpoint's metadata names it; "
                        "the checkpoint is incomplete. Load an earlier checkpoint."
                    ) from None
                self._fds[name] = fd
            return fd

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        fd = self._reader_fd(name)
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CheckpointCorruptError(
                    f"{self._path(name)} ends at byte {offset + done}, but bytes up to "
                    f"{offset + len(view)} were expected; the file is truncated. Load an earlier "
                    "checkpoint."
                )
            done += n

    def map_range(self, name: str, offset: int, length: int) -> memoryview | None:
        fd = self._reader_fd(name)
        if os.fstat(fd).st_size < offset + length:
            return None  # mapping past the end would fault on access; the caller reads instead
        # From a multiple of 2 MiB: the kernel then places the mapping so that huge pages of the
        # page cache, where it holds them, are mapped whole (x86-64: one fault per 2 MiB).
        start = offset // _HUGE * _HUGE
        prot = mmap.PROT_READ | mmap.PROT_WRITE  # copy on write: tensors want a writable buffer
        try:
            mapped = mmap.mmap(fd, offset + length - start, mmap.MAP_PRIVATE, prot, offset=start)
        except OSError:  # no address space or commit charge left for it: the caller reads
            return None
        return memoryview(mapped)[offset - start :]

    def size(self, name: str) -> int | None:
        try:
            st = self._path(name).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def write_atomic(self, name: str, data: bytes) -> None:
        self.ensure_root()
        final = self._path(name)
        tmp = self.root / temp_name(check_name(name), small=True)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_dir(self.root)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _os_error(e, f"writing {final}") from e

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def list_names(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.root) if not is_temp_name(n))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, name: str) -> None:
        with contextlib.suppress(IsADirectoryError):
            self._path(name).unlink(missing_ok=True)

    def remove_tree(self, name: str) -> None:
        path = self._path(name)
        try:
            shutil.rmtree(path)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:
            raise _os_error(e, f"deleting {path}") from e

    def is_file(self) -> bool:
        return self.root.is_file()

    def acquire_lock(self) -> HeldLock:
        """An exclusive advisory lock on ``LOCK`` in the folder, released at process exit too.

        ``LOCK`` records its holder and a token of its own. The lock's check finds it taken
        when the file under the name is no longer the one locked (deleted, or replaced: a
        second writer then locks the new file) or holds another writer's record (a file
        system whose ``flock`` does not reach across hosts lets a writer on another host in).
        """
        self.ensure_root()
        path = self.root / "LOCK"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _os_error(e, f"locking {self.root}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_of(path.read_bytes())
            os.close(fd)
            raise CheckpointLockedError(
                f"{self.root} is being written by {holder}; two jobs must not save into the same "
                "place. Stop the other job or choose another path."
            ) from None
        record = f"pid {os.getpid()} on {socket.gethostname()}\ntoken {uuid.uuid4().hex}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        self.remove_temporary_files()

        def release() -> None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

        return HeldLock(release, functools.partial(_check_lock, path, fd, record.encode()))

    def remove_temporary_files(self) -> None:
        """Delete the temporary files of writers that died mid-file (called under the lock or
        at a commit: no live writer of the folder has any)."""
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            if is_temp_name(name):
                log.info("removing %s, left by a writer that did not finish", self.root / name)
                with contextlib.suppress(FileNotFoundError):
                    (self.root / name).unlink()

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
