"""The one exception hierarchy of unickpt.

Every message says what was found, what was expected and what to do next.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error unickpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError):
    """The path holds no committed checkpoint."""


class CheckpointCorruptError(CheckpointError):
    """The checkpoint's bytes or metadata are damaged (checksum, size or syntax)."""


class CheckpointVersionError(CheckpointError):
    """The checkpoint was written by a newer format version than this unickpt reads."""


class CheckpointMismatchError(CheckpointError):
    """The state to load does not match the checkpoint (keys, shapes, dtypes, world size)."""


class CheckpointExistsError(CheckpointError):
    """A committed checkpoint is already at the destination and overwriting was not asked for."""


class UnsafeObjectError(CheckpointError):
    """A value would need pickle, and pickle was not allowed."""


class CheckpointLockedError(CheckpointError):
    """Another job is saving into the same place."""


class DistributedCheckpointError(CheckpointError):
    """One or more ranks failed; raised on every rank with every rank's message."""

    def __init__(self, message: str, rank_errors: dict[int, str]) -> None:
        super().__init__(message)
        self.rank_errors = rank_errors
