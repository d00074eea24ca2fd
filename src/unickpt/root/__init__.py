"""A Checkpointer's root: step names and listing (:mod:`.names`), its identity
(:mod:`.identity`), and the agreed decisions about its steps (:mod:`.root`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .identity import ROOT_ID_FILE, RootIdentity
from .names import committed_steps, open_checkpoint, step_folders, step_name, step_of

if TYPE_CHECKING:
    from .root import Root


def __getattr__(name: str) -> Any:
    # Root agrees on decisions over torch.distributed: imported when first used, so that
    # naming and listing steps (the command line's) imports no torch.
    if name == "Root":
        from .root import Root

        return Root
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ROOT_ID_FILE",
    "Root",
    "RootIdentity",
    "committed_steps",
    "open_checkpoint",
    "step_folders",
    "step_name",
    "step_of",
]
