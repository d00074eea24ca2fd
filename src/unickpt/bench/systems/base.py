"""The interface every benchmarked system implements.

The runner calls, on every rank and in this order: ``save`` (returns when the call returns),
``SaveHandle.wait_until_mutable`` (what the training loop must wait for before changing the
state), one training iteration, ``SaveHandle.wait`` (durable), then ``load`` into the same
layout and ``reshard_load`` into the other one, then ``close``.
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
    """One way of checkpointing a :class:`TrainState`; one instance per rank and run."""

    #: A sentence for the report on how this system was run (what is gathered, what fsyncs).
    notes: str = ""

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

    def close(self) -> None:  # noqa: B027 - most systems hold nothing
        """Release what the system holds (threads, staging buffers, shared memory)."""
