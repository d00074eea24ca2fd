"""Any file system fsspec knows (``gs://``, ``az://``, ``memory://``, ``file://`` ...).

What this backend promises is less than the local one (see docs/storage.md):

- no fsync: a completed file is as durable as the file system makes a closed file;
- files are written under a temporary name (:func:`~.base.temp_name`) and moved onto their
  name once closed, so a writer killed mid-file leaves nothing under the file's name (and
  listings never show temporary names); except on object stores (``s3``, ``gs``, ``az`` ...),
  where an object appears whole when its upload closes and a move would copy it. The move is
  atomic where the file system's rename is (``file://``); elsewhere it is a copy then a
  delete;
- no lock: two writers on one folder are not refused, and the temporary files of a killed
  writer stay until its folder is removed as a whole (a Checkpointer's debris removal of an
  unfinished step folder does that);
- data files are written in order, one stream per file: parts that arrive early are held in
  memory (at most ``max_buffered_bytes`` per file, then their writers wait their turn).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import fsspec

from ..errors import CheckpointCorruptError, CheckpointError
from .base import Storage, StreamHandle, WriteHandle, check_name, is_temp_name, temp_name

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_MAX_BUFFERED_BYTES = 256 * MiB
_WHOLE_ON_CLOSE = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def appears_whole(fs: Any) -> bool:
    """Whether ``fs`` is an object store, where a file written appears only when closed,
    whole (so it needs no temporary name, and a move would copy it)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in _WHOLE_ON_CLOSE for p in protocols)


def _fs_error(e: Exception, what: str) -> CheckpointError:
    return CheckpointError(f"{what} failed: {type(e).__name__}: {e}; check the URL and access.")


class _OneStream:
    """One fsspec stream ``_file`` at ``_path``, moved onto ``_final`` once closed (None: it
    stays where it is written, as on object stores); removed when discarded."""

    _fs: Any
    _path: str
    _final: str | None
    _moved: bool
    _file: Any
    location: str

    def _open(self, fs: Any, path: str, final: str | None) -> None:
        self._fs, self._path, self._final = fs, path, final
        self._moved = False
        try:
            self._file = fs.open(path, "wb")
        except Exception as e:
            raise _fs_error(e, f"creating {self.location}") from e

    def _stream(self, buffers: Sequence[memoryview | bytes]) -> None:
        try:
            for b in buffers:
                self._file.write(b)
        except Exception as e:
            raise _fs_error(e, f"writing {self.location}") from e

    def _close_and_move(self) -> None:
        try:
            self._file.close()
            if self._final is not None:
                self._fs.mv(self._path, self._final)
                self._moved = True
        except Exception as e:
            raise _fs_error(e, f"closing {self.location}") from e

    def _remove(self) -> None:
        with contextlib.suppress(Exception):
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self._final if self._moved and self._final else self._path)


class _SequentialWriteHandle(_OneStream, WriteHandle):
    """Parts written to one fsspec stream in index order; early parts held, bounded."""

    def __init__(
        self,
        fs: Any,
        path: str,
        location: str,
        part_sizes: Sequence[int],
        max_buffered: int,
        final: str | None = None,
    ) -> None:
        """Write to ``path``; ``final``: the name it is moved to once complete (None: stays)."""
        super().__init__(location, part_sizes, 0)
        self._max_buffered = max_buffered
        self._next = 0
        self._held: dict[int, list[bytes]] = {}
        self._held_bytes = 0
        self._open(fs, path, final)

    def _write_part(self, index: int, buffers: list[memoryview]) -> None:
        size = self.part_sizes[index]
        with self._cond:
            if index != self._next and self._held_bytes + size <= self._max_buffered:
                self._held[index] = [bytes(b) for b in buffers]
                self._held_bytes += size
                return
            while index != self._next and not self.aborted:
                self._cond.wait()
            if self.aborted:
                raise CheckpointError(f"writing {self.location} was aborted.")
        self._stream(buffers)
        with self._cond:
            self._next = index + 1
            while self._next in self._held:
                held = self._held.pop(self._next)
                self._stream(held)
                self._held_bytes -= self.part_sizes[self._next]
                self._next += 1
            self._cond.notify_all()

    def _complete(self) -> None:
        if self._next != len(self.part_sizes):
            raise AssertionError(f"{self.location}: completed with parts missing")
        self._close_and_move()

    def _discard(self) -> None:
        self._held.clear()
        self._remove()


class _StreamHandle(_OneStream, StreamHandle):
    """A data file written front to back to one fsspec stream, moved onto its name once
    closed (``final``; None: it stays where it is written, as on object stores)."""

    def __init__(self, fs: Any, path: str, location: str, final: str | None = None) -> None:
        super().__init__(location)
        self._open(fs, path, final)

    def _append(self, buffers: list[memoryview]) -> None:
        self._stream(buffers)

    def _complete(self) -> None:
        self._close_and_move()

    def _discard(self) -> None:
        self._remove()


class FsspecStorage(Storage):
    """A folder on an fsspec file system, addressed by URL (``memory://run/ckpt``).

    >>> s = FsspecStorage("memory://demo/ckpt")
    >>> s.write_atomic("x", b"1"); s.read_bytes("x")
    b'1'
    """

    def __init__(
        self,
        url: str,
        *,
        fs: Any = None,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        **options: Any,
    ) -> None:
        if fs is None:
            fs, url = fsspec.core.url_to_fs(url, **options)
        self.fs = fs
        self.path = str(url).rstrip("/") or "/"
        self.max_buffered_bytes = max_buffered_bytes
        self.renames = not appears_whole(fs)
        """Whether files are written under a temporary name and moved onto their own."""
        self._made = False

    @property
    def location(self) -> str:
        return str(self.fs.unstrip_protocol(self.path))

    def _full(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{check_name(name)}"

    def child(self, name: str) -> FsspecStorage:
        return FsspecStorage(
            self._full(name), fs=self.fs, max_buffered_bytes=self.max_buffered_bytes
        )

    def parent(self) -> FsspecStorage | None:
        head, sep, _ = self.path.rstrip("/").rpartition("/")
        if not sep:
            return None
        return FsspecStorage(head or "/", fs=self.fs, max_buffered_bytes=self.max_buffered_bytes)

    def _ensure_root(self) -> None:
        if not self._made:
            try:
                self.fs.makedirs(self.path, exist_ok=True)
            except Exception as e:
                raise _fs_error(e, f"creating the folder {self.location}") from e
            self._made = True

    def _all_names(self) -> set[str]:
        self.fs.invalidate_cache(self.path)
        try:
            entries = self.fs.ls(self.path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return set()
        own = self.path.rstrip("/")
        paths = (str(self.fs._strip_protocol(e)).rstrip("/") for e in entries)
        return {p.rsplit("/", 1)[-1] for p in paths if p != own}

    def list_names(self) -> list[str]:
        return sorted(n for n in self._all_names() if not is_temp_name(n))

    def remove_temporary_files(self) -> None:
        for name in sorted(n for n in self._all_names() if is_temp_name(n)):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._full(name))

    def size(self, name: str) -> int | None:
        try:
            info = self.fs.info(self._full(name))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        path = self._full(name)
        try:
            data = self.fs.cat_file(path, start=offset, end=offset + len(view))
        except FileNotFoundError:
            raise CheckpointCorruptError(
                f"{self.location}/{name} is missing, but the checkpoint's metadata names it; "
                "the checkpoint is incomplete. Load an earlier checkpoint."
            ) from None
        if len(data) != len(view):
            raise CheckpointCorruptError(
                f"{self.location}/{name} ends at byte {offset + len(data)}, but bytes up to "
                f"{offset + len(view)} were expected; the file is truncated. Load an earlier "
                "checkpoint."
            )
        view[:] = data

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(self._full(name)))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def write_atomic(self, name: str, data: bytes) -> None:
        path = self._full(name)
        self._ensure_root()
        temp = self._full(temp_name(name, small=True)) if self.renames else path
        try:
            self.fs.pipe_file(temp, bytes(data))
            if temp != path:
                self.fs.mv(temp, path)
        except Exception as e:
            with contextlib.suppress(Exception):
                if temp != path:
                    self.fs.rm_file(temp)
            raise _fs_error(e, f"writing {self.location}/{name}") from e

    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        path = self._full(name)
        self._ensure_root()
        where = f"{self.location}/{name}"
        if not self.renames:
            return _SequentialWriteHandle(self.fs, path, where, part_sizes, self.max_buffered_bytes)
        temp = self._full(temp_name(name))
        return _SequentialWriteHandle(
            self.fs, temp, where, part_sizes, self.max_buffered_bytes, final=path
        )

    def create_stream(self, name: str) -> StreamHandle:
        """One fsspec stream written front to back (under a temporary name where files are
        moved onto their own, see :attr:`renames`)."""
        if self.streams_through_create(FsspecStorage):
            return super().create_stream(name)
        path = self._full(name)
        self._ensure_root()
        where = f"{self.location}/{name}"
        temp = self._full(temp_name(name)) if self.renames else None
        return _StreamHandle(self.fs, temp or path, where, path if temp else None)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._full(name))

    def remove_tree(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._full(name), recursive=True)

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.path))
