"""The copy phase of a save (:func:`copy`): the bytes this rank writes, into the staging
memory its turn in the save queue lends it (:mod:`.queue`): a whole snapshot when they fit the
budget, else a bounded ring of the budget's size (:mod:`unickpt.engine.ring`), else none (a
compressed or incremental save above the budget writes from the live tensors). A zero-stall
save's tensors are checked unchanged since the call once copied."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.ring import Stager
from ..engine.snapshot import snapshot
from ..engine.sources import ItemSource, needs_pinned
from .plan import PlannedSave
from .save import Save


@dataclass(frozen=True)
class Copy:
    """Where phase 3 left the bytes this rank writes: ``sources``, what the write reads (the
    copy, or the live tensors); ``stager``, the bounded ring the write's parts come through;
    ``check``, run before and after the write, raising to fail it on every rank."""

    sources: list[ItemSource]
    stager: Stager | None = None
    check: Callable[[], None] | None = None


def stages(save: Save, planned: PlannedSave) -> bool:
    """Whether phase 3 copies: the bytes fit the budget, or a bounded ring can take them
    (a plain full write: a compressed or incremental one reads each tensor more than once,
    or out of file order)."""
    o, ring = save.options, 2 * save.config.segment_bytes
    small = planned.nbytes <= save.budget
    return small or (not o.compress and o.incremental is None and save.budget >= ring)


def copy(
    save: Save,
    planned: PlannedSave,
    check: Callable[[str], None] | None = None,
    intra_op: bool = False,
    marker: Any = None,
) -> Copy:
    """Phase 3. With ``check`` (zero-stall: raises when the tensor at a key of the state
    changed since the call), each tensor is checked once copied (or, without a copy, before
    and after the write); ``marker``, a CUDA event the copy waits for. Never raises: a
    failure becomes a check that fails the write, so that every rank learns of it."""
    views, items = planned.views, planned.items
    keys = [planned.state_key(i.key) for i in items]  # as the capture knows them
    check_item = None if check is None else _checking(check, keys)
    failed: Exception | None = None
    try:
        if marker is not None:
            marker.synchronize()
        if not stages(save, planned):  # the write reads the live tensors
            return Copy(live(planned), check=None if check is None else lambda: _each(check, keys))
        small = planned.nbytes <= save.budget
        room = save.turn.room(planned.file_bytes if small else save.budget, needs_pinned(views))
        if not small:
            done = save.future.set_snapshot_done
            return Copy(live(planned), Stager(views, room, check_item, on_copied=done))
        sources = snapshot(items, views, room, save.config.io_threads, check_item, intra_op)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the write
        sources, failed = [], e
    save.future.set_snapshot_done()
    return Copy(sources, check=None if failed is None else _raising(failed))


def live(planned: PlannedSave) -> list[ItemSource]:
    """The tensors themselves, as the write's sources."""
    return [ItemSource(v) for v in planned.views]


def _checking(check: Callable[[str], None], keys: list[str]) -> Callable[[int], None]:
    """A check of item ``i``'s tensor: unchanged since the call."""
    return lambda i: check(keys[i])


def _each(check: Callable[[str], None], keys: list[str]) -> None:
    for key in keys:
        check(key)


def _raising(error: Exception) -> Callable[[], None]:
    def fail() -> None:
        raise error

    return fail
