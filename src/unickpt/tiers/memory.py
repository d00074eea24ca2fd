"""The memory tier's settings and a node's folder of memory checkpoints for one job.

A memory checkpoint is an ordinary checkpoint (same format, checksums, commit marker) in a
folder on the node's shared memory (``/dev/shm/unickpt`` by default: tmpfs, memory owned by
the operating system, so it outlives every training process of the node). Layout::

    <dir>/<job>/step-000000005/   COMMIT, metadata, the data and index files of the node's own
                                  ranks, and the replica files it keeps for its partner node

``<job>`` is derived from the identity of the Checkpointer's root (:mod:`unickpt.root.identity`:
its resolved location and the id written at its first save), so it is stable across restarts
and distinct between roots: two jobs whose roots are both called ``"ckpt"`` in different
folders, or a root deleted and saved into again, never share memory checkpoints. The job
folder's ``OWNER`` file names the root it belongs to.

A data file counts as present only once its index file is there: the index is written after
the data is complete, by a local save and by a received replica alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from ..format.metadata import COMMIT_FILE
from ..root.identity import RootIdentity
from ..root.names import step_name
from ..storage.base import WriteHandle
from ..storage.local import LocalStorage, LocalWriteHandle, os_error

DEFAULT_DIR = "/dev/shm/unickpt"
SPARE = ".spare"
_STEP = re.compile(r"^step-(\d+)$")
_DATA = re.compile(r"^data-([0-9a-f]+)-(\d+)\.bin$")


@dataclass(frozen=True)
class MemoryTier:
    """Keep checkpoints in the nodes' memory; persist every ``persist_every``-th save.

    ``replicas=2`` also keeps each rank's files in one other node's memory (any one node may
    be lost); ``replicas=1`` keeps them in local memory only. ``dir`` is the node's folder of
    memory checkpoints (default ``/dev/shm/unickpt``, or ``UNICKPT_MEMORY_DIR``);
    ``persist_deadline_s`` bounds the save on the way down (:meth:`Checkpointer.guard`).

    >>> tier = unickpt.MemoryTier(persist_every=10, replicas=2)  # doctest: +SKIP
    >>> ckpt = unickpt.Checkpointer("s3://bucket/run", keep_last=3, memory=tier)  # doctest: +SKIP
    """

    persist_every: int = 10
    replicas: int = 2
    dir: str | os.PathLike[str] | None = None
    persist_deadline_s: float = 120.0

    def __post_init__(self) -> None:
        if self.persist_every < 1:
            raise CheckpointError(
                f"persist_every is {self.persist_every}; expected at least 1 (1 persists every "
                "save to storage)."
            )
        if self.replicas < 1:
            raise CheckpointError(
                f"replicas is {self.replicas}; expected 1 (local memory only) or more (copies "
                "in other nodes' memory)."
            )
        if self.persist_deadline_s <= 0:
            raise CheckpointError(
                f"persist_deadline_s is {self.persist_deadline_s}; expected a positive number."
            )

    @property
    def folder(self) -> Path:
        """Where the node's memory checkpoints live: ``dir``, else ``UNICKPT_MEMORY_DIR``, else
        a folder in ``/dev/shm``."""
        return Path(self.dir or os.environ.get("UNICKPT_MEMORY_DIR") or DEFAULT_DIR)


def job_name(identity: RootIdentity) -> str:
    """The job's folder name under ``dir``: readable, and distinct for distinct roots."""
    tail = re.sub(r"[^A-Za-z0-9_-]+", "-", identity.location.rstrip("/").rsplit("/", 1)[-1])
    digest = hashlib.blake2b(identity.key.encode(), digest_size=8).hexdigest()
    return f"{tail.strip('-')[:40] or 'job'}-{digest}"


def index_of(data: str) -> str:
    """The index file that lists the chunks of data file ``data``."""
    m = _DATA.match(data)
    if m is None:
        raise CheckpointError(f"{data!r} is not a unickpt data file name (data-<id>-<rank>.bin).")
    return f"index-{m.group(1)}-{m.group(2)}.json"


@dataclass(frozen=True)
class Holding:
    """What a node's folder holds of one step: the commit (if any) and the complete files."""

    step: int
    metadata_file: str | None
    required: tuple[str, ...]
    present: frozenset[str]


OWNER_FILE = "OWNER"


class MemoryStore:
    """One root's memory checkpoints in one node's folder."""

    def __init__(self, base: Path, identity: RootIdentity) -> None:
        self.base = base
        self.identity = identity
        self.root = base / job_name(identity)

    def claim(self) -> None:
        """Name the root these memory checkpoints belong to (before the first is written)."""
        owner = self.root / OWNER_FILE
        if owner.is_file():
            self._check_owner()
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{OWNER_FILE}.{os.getpid()}"
        tmp.write_text(self.identity.key)
        os.replace(tmp, owner)

    def _check_owner(self) -> bool:
        """Whether the folder is this root's (a folder without an owner is nobody's yet)."""
        try:
            found = (self.root / OWNER_FILE).read_text()
        except FileNotFoundError:
            return True
        if found != self.identity.key:
            raise CheckpointError(
                f"the memory folder {self.root} belongs to the root {found!r}, not to "
                f"{self.identity.key!r}; it is never read from or deleted for another root. "
                "Set MemoryTier(dir=...) to another folder."
            )
        return True

    def step_path(self, step: int) -> Path:
        return self.root / step_name(step)

    def step(self, step: int) -> LocalStorage:
        """The step's folder, as the storage the engine saves into and loads from."""
        return LocalStorage(self.step_path(step))

    def steps(self) -> list[int]:
        """Every step folder (committed or not), ascending."""
        return sorted(int(m.group(1)) for m in map(_STEP.match, _listdir(self.root)) if m)

    def committed(self) -> list[int]:
        return [s for s in self.steps() if (self.step_path(s) / COMMIT_FILE).is_file()]

    def present(self, step: int) -> frozenset[str]:
        """Data files of the step whose index file is there too (so the data is complete)."""
        names = set(_listdir(self.step_path(step)))
        return frozenset(n for n in names if _DATA.match(n) and index_of(n) in names)

    def holdings(self) -> list[Holding]:
        """What this node holds of every step (a damaged commit counts as none)."""
        from ..engine.commit import read_commit
        from ..format.codec import decode_metadata

        self._check_owner()
        found = []
        for step in self.steps():
            storage = self.step(step)
            meta_file: str | None = None
            required: tuple[str, ...] = ()
            with contextlib.suppress(CheckpointError):
                record = read_commit(storage)
                raw = storage.read_bytes(record.metadata_file) if record else None
                if record is not None and raw is not None:
                    required = decode_metadata(raw, str(self.step_path(step))).files
                    meta_file = record.metadata_file
            found.append(Holding(step, meta_file, required, self.present(step)))
        return found

    def remove(self, step: int) -> None:
        """Delete one step: the marker first, so a crash midway never leaves a half checkpoint."""
        path = self.step_path(step)
        with contextlib.suppress(FileNotFoundError):
            (path / COMMIT_FILE).unlink()
        shutil.rmtree(path, ignore_errors=True)

    def retire(self, keep: set[int]) -> list[int]:
        """Delete every step folder but ``keep``; the steps deleted.

        The data files of a deleted step (this node's ranks' and the replicas it kept) become
        spares, for the next save's files and replicas to be written over in place
        (:meth:`take_spare`): their memory pages are reused instead of freed and allocated
        again, which on tmpfs costs more than the copy itself (zeroing every page, in the
        training loop's stall when freed there). Spares of earlier steps still unused by then
        are deleted.
        """
        spare = self.root / SPARE
        shutil.rmtree(spare, ignore_errors=True)
        gone = [s for s in self.steps() if s not in keep]
        for step in gone:
            path = self.step_path(step)
            with contextlib.suppress(FileNotFoundError):
                (path / COMMIT_FILE).unlink()
            for name in _listdir(path):
                if _DATA.match(name):
                    spare.mkdir(exist_ok=True)
                    with contextlib.suppress(FileNotFoundError):
                        os.replace(path / name, spare / f"{step}-{name}")
            self.remove(step)
        return gone

    def take_spare(self, dest: Path, nbytes: int) -> bool:
        """Move a spare file to ``dest``, to be written over in place: the smallest holding
        ``nbytes``, else the largest. False when there is none (another rank of the node may
        take the same spare first: a rename moves it to one of them only)."""
        folder = self.root / SPARE
        sizes: list[tuple[int, str]] = []
        for name in _listdir(folder):
            with contextlib.suppress(FileNotFoundError):
                sizes.append((os.stat(folder / name).st_size, name))
        fits = sorted(s for s in sizes if s[0] >= nbytes) or sorted(sizes, reverse=True)
        for _, name in fits:
            with contextlib.suppress(FileNotFoundError):
                os.replace(folder / name, dest)
                return True
        return False

    def step_storage(self, step: int) -> RecyclingStorage:
        """The step's folder as the storage a save writes into, its data files on spares."""
        return RecyclingStorage(self.step_path(step), self)

    def clear(self) -> None:
        """Delete the job's folder (and ``dir`` when nothing else is left in it)."""
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.base.rmdir()


class RecyclingStorage(LocalStorage):
    """A memory step folder whose new data files take the pages of spare ones."""

    def __init__(self, path: Path, store: MemoryStore) -> None:
        super().__init__(path)
        self._store = store

    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        if not _DATA.match(name):
            return super().create(name, part_sizes)
        self.ensure_root()
        path = self.root / name
        reuse = self._store.take_spare(path, sum(part_sizes))
        return LocalWriteHandle(path, part_sizes, overwrite=reuse)


@contextlib.contextmanager
def folder_errors(what: str) -> Iterator[None]:
    """An OSError of a node folder raised as a CheckpointError saying what failed and what to
    do (the node's memory full, the folder not writable)."""
    try:
        yield
    except OSError as e:
        raise os_error(
            e,
            what,
            full="the node's memory folder is full: free memory there, keep fewer replicas, or "
            "set MemoryTier(dir=...) to a larger tmpfs.",
            unwritable="the folder is not writable: fix its permissions or set "
            "MemoryTier(dir=...).",
            other="check the node's memory folder (was it changed from outside the job?).",
        ) from e


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
