"""A save on this rank: what it was asked to do (:class:`SaveOptions`) and where it stands
(:class:`Save`: its target, process group, turn in the save queue and future). Every phase
(:mod:`unickpt.saving.pipeline`) takes it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..dist import Comm
from ..engine.futures import SaveFuture
from ..engine.incremental import IncrementalSave
from ..errors import CheckpointError
from ..layouts.rules import LayoutMap
from ..planning.flatten import KeyMap
from ..storage.base import Storage
from .queue import QUEUE


@dataclass(frozen=True)
class SaveOptions:
    """What a save was asked to do, beyond its target and state (see :func:`unickpt.save`
    and :func:`unickpt.async_save`). ``staging_bytes`` None: the config's budget."""

    allow_pickle: bool = False
    overwrite: bool = False
    quantize: dict[str, int] | None = None
    compress: bool = False
    lock: bool = True
    layout: LayoutMap | None = None
    keys: KeyMap | None = None
    staging_bytes: int | None = None
    incremental: IncrementalSave | None = None
    on_commit: Callable[[], None] | None = None
    progress: Callable[[int, int], None] | None = None


class Save:
    """One save on this rank, from its call to its commit: where it goes, how, its process
    group, its turn in the save queue and its future. Made in the caller's thread on every
    rank (it may create the save's process group), it takes its turn at once: saves run in
    the order they were called."""

    def __init__(self, storage: Storage, group: Any, config: Config, options: SaveOptions) -> None:
        self.storage = storage
        self.config = config
        self.options = options
        self.budget = staging_budget(options.staging_bytes, config)
        self.comm = Comm(group, config.collective_timeout_s)
        future = SaveFuture()
        future.path = storage.location
        self.turn = QUEUE.admit(future)
        self.future = future


def staging_budget(staging_bytes: int | None, cfg: Config) -> int:
    """``staging_bytes`` checked, or the config's budget."""
    if staging_bytes is None:
        return cfg.staging_budget_bytes
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int):
        raise CheckpointError(
            f"staging_bytes is {staging_bytes!r}; expected a number of bytes (an int) or None "
            "for the config's staging_budget_bytes."
        )
    if staging_bytes < 2 * cfg.segment_bytes:
        raise CheckpointError(
            f"staging_bytes is {staging_bytes}; expected at least two checksum segments "
            f"({2 * cfg.segment_bytes} bytes). A budget of a few parts (64 MiB or more) keeps "
            "copies and writes overlapped."
        )
    return staging_bytes
