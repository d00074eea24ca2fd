"""A Checkpointer's root: step names and listing (:mod:`.names`), its identity
(:mod:`.identity`), and the agreed decisions about its steps (:mod:`.root`)."""

from .identity import ROOT_ID_FILE, RootIdentity
from .names import committed_steps, open_checkpoint, step_folders, step_name, step_of
from .root import Root

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
