"""The interface every benchmarked system implements.

One instance per rank and run, in a fresh process. The runner calls, on every rank and in this
order: a warm-up ``save`` and its waits (unless ``--no-warmup``), then the measured ``save``
(returns when the call returns), ``SaveHandle.wait_until_mutable`` (what the training loop must
wait for before changing the state), one training iteration, ``SaveHandle.wait`` (durable), then
``load`` into the same layout and ``reshard_load`` into the other one, ``extra_measures``, then
``close``. The state's tensors are on ``state.device`` (``"cpu"`` or ``"cuda"``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from unickpt.bench.model import TrainState
from unickpt.bench.systems.registry import SystemInfo


class Unsupported(Exception):
    """The system cannot do this phase (for example, load into another layout)."""


class SaveHandle:
    """What a save returns. The default is a completed synchronous save.

    ``step_waits`` says that the next ``optimizer.step()`` waits for the save (a hook), so the
    extra time of that step counts as blocking.
    """

    step_waits: bool = False

    def wait_until_mutable(self) -> None:
        """Block until the caller may modify the saved tensors."""

    def wait(self) -> None:
        """Block until the checkpoint is durable and committed."""


class CheckpointSystem(ABC):
    """One way of checkpointing a :class:`TrainState`; one instance per rank and run.

    Run every system at its best settings for the machine (writer threads, caching, staging),
    and say which in ``notes``: the report prints them beside the row.
    """

    #: Sentences for the report on how this system was run (settings, what fsyncs); set it in
    #: ``__init__`` when it depends on the machine or the device.
    notes: str = ""

    #: Bytes the last load says it read, where the system counts them itself (None: it does
    #: not). Reads through memory mappings escape the kernel's read-call counter (``rchar``).
    bytes_read_reported: int | None = None

    def __init__(self, info: SystemInfo) -> None:
        self.info = info

    @abstractmethod
    def save(self, path: Path, state: TrainState) -> SaveHandle:
        """Start saving ``state`` under ``path`` (a fresh directory name)."""

    @abstractmethod
    def load(self, path: Path, state: TrainState) -> None:
        """Load ``path`` into ``state`` in place; ``state`` has the layout it was saved from."""

    def reshard_load(self, path: Path, state: TrainState) -> None:
        """Load ``path`` into ``state`` whose layout differs from the saved one."""
        self.load(path, state)

    def extra_measures(self, path: Path, state: TrainState) -> dict[str, float]:
        """Figures beyond the standard phases, keyed by measures declared in
        ``unickpt.bench.measures.MEASURES``. Called on every rank (collectives allowed, in the
        same order everywhere) after the loads, while the checkpoint at ``path`` still exists;
        ``state`` holds the saved values again."""
        return {}

    def close(self) -> None:  # noqa: B027 - most systems hold nothing
        """Release what the system holds (threads, staging buffers, shared memory)."""
