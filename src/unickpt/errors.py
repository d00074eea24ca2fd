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


class RecoveryError(CheckpointError):
    """``unickpt run`` or :func:`unickpt.recover` could not go on (the job's store, a
    membership, a process that did not leave its training function in time)."""


class DistributedCheckpointError(CheckpointError):
    """One or more ranks failed; raised on every rank with every rank's message."""

    def __init__(self, message: str, rank_errors: dict[int, str]) -> None:
        super().__init__(message)
        self.rank_errors = rank_errors


class MembershipChanged(BaseException):
    """Raised inside the training function that :func:`unickpt.recover` runs, when another
    process of the job failed: the function unwinds, and recover calls it again once the
    process groups are formed anew (a spare in the failed rank's place). Not an error, and not
    an ``Exception``: ``except Exception`` in training code lets it through."""
