"""Checkpointer: numbered checkpoints under one root, for training loops.

One folder per step (``step-000000100``), counted only once committed; the newest intact one
is found on restart, damaged ones are skipped with a warning; old ones are deleted only after
a newer one is committed; folders left by an interrupted save are removed by a later save.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import api
from .config import Config, get_config
from .dist import Comm, run_step
from .engine.futures import SaveFuture
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLockedError,
    CheckpointNotFoundError,
)
from .format.metadata import COMMIT_FILE
from .storage.local import LocalStorage

log = logging.getLogger(__name__)

_STEP = re.compile(r"^step-(\d+)$")


class Checkpointer:
    """Save every few steps, resume from the newest intact checkpoint.

    >>> ckpt = unickpt.Checkpointer("runs/gpt", keep_last=3)  # doctest: +SKIP
    >>> last = ckpt.load_latest(state)  # doctest: +SKIP
    >>> start = 0 if last is None else last + 1  # doctest: +SKIP
    >>> for step in range(start, steps):  # doctest: +SKIP
    ...     train_step()
    ...     if step % 100 == 0:
    ...         ckpt.save(step, state)
    >>> ckpt.close()  # doctest: +SKIP

    The checkpoint of step N holds the state after step N: a resumed loop goes on with N + 1.

    All ranks of ``group`` construct it and call ``save``/``load_latest`` together. ``root``
    is locked for the Checkpointer's lifetime, so two jobs cannot write into it at once.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        group: Any = None,
        async_save: bool = True,
        background_snapshot: bool = False,
        config: Config | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last is {keep_last}; expected None or at least 1.")
        self.root = Path(root)
        self.keep_last = keep_last
        self.group = group
        self.async_save = async_save
        self.background_snapshot = background_snapshot
        self.config = config or get_config()
        self._comm = Comm(group, self.config.collective_timeout_s)
        self._pending: SaveFuture | None = None
        self._release: Callable[[], None] | None = None

        def lock() -> tuple[Callable[[], None] | None, None]:
            if not self._comm.is_coordinator:
                return None, None
            try:
                return LocalStorage(self.root).acquire_lock(), None
            except CheckpointLockedError:
                raise
            except CheckpointError as e:
                log.warning("%s; checkpoints here can be loaded but not saved", e)
                return None, None

        self._release, _ = run_step(self._comm, "opening the checkpoint root", lock)

    def path(self, step: int) -> str:
        return str(self.root / f"step-{step:09d}")

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            m = _STEP.match(name)
            if m and (self.root / name / COMMIT_FILE).is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    def save(self, step: int, state: dict[str, Any]) -> SaveFuture:
        """Save ``state`` as ``step``: asynchronous unless ``async_save=False``."""
        self.wait()
        if step < 0:
            raise CheckpointError(f"step is {step}; expected a non-negative integer.")
        if self._comm.is_coordinator:
            self._remove_debris(keep=step)
        if not self.async_save:
            report = api.save(
                self.path(step), state, group=self.group, overwrite=True, config=self.config
            )
            self._retain(step)
            return SaveFuture.completed(report)
        self._pending = api.async_save(
            self.path(step),
            state,
            group=self.group,
            overwrite=True,
            background_snapshot=self.background_snapshot,
            config=self.config,
            on_commit=lambda: self._retain(step),
        )
        return self._pending

    def load_latest(self, state: dict[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest intact checkpoint into ``state``; its step, or None when none."""
        self.wait()
        steps = self._comm.broadcast(self.steps())
        for step in reversed(steps):
            try:
                api.load(
                    self.path(step), state, group=self.group, strict=strict, config=self.config
                )
                return step
            except (CheckpointCorruptError, CheckpointNotFoundError) as e:
                warnings.warn(
                    f"checkpoint of step {step} at {self.path(step)} cannot be loaded ({e}); "
                    "falling back to the one before.",
                    stacklevel=2,
                )
        return None

    def wait(self) -> None:
        """Wait for the pending asynchronous save; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None and not (pending.done() and pending.error_reported):
            pending.wait()

    def close(self) -> None:
        """Wait for pending saves and release the root."""
        try:
            self.wait()
        finally:
            if self._release is not None:
                self._release()
                self._release = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _retain(self, newest: int) -> None:
        if self.keep_last is None or not self._comm.is_coordinator:
            return
        older = [s for s in self.steps() if s < newest]
        for step in older[: max(0, len(older) - (self.keep_last - 1))]:
            _delete_checkpoint(Path(self.path(step)))

    def _remove_debris(self, keep: int) -> None:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        for name in names:
            m = _STEP.match(name)
            folder = self.root / name
            if m and int(m.group(1)) != keep and not (folder / COMMIT_FILE).exists():
                log.info("removing %s, left by an interrupted save", folder)
                shutil.rmtree(folder, ignore_errors=True)


def _delete_checkpoint(folder: Path) -> None:
    """Uncommit first, so a crash midway leaves debris, never a half-deleted checkpoint."""
    (folder / COMMIT_FILE).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
