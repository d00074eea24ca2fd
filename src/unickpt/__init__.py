"""unickpt: one checkpoint format for every PyTorch parallel layout.

Save from any layout (single process, DDP, FSDP2, tensor parallel, explicit or flat shards),
load into any other world size or layout, fast and safely.

>>> import torch, unickpt
>>> model = torch.nn.Linear(4, 2)
>>> unickpt.save("/tmp/unickpt-doc/init", {"model": model}, overwrite=True)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:
    from .api import async_save, load, prepare_staging, save, wait_pending
    from .checkpointer import Checkpointer
    from .config import Config, get_config
    from .engine.futures import SaveFuture
    from .errors import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointExistsError,
        CheckpointLockedError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointVersionError,
        DistributedCheckpointError,
        MembershipChanged,
        RecoveryError,
        UnsafeObjectError,
    )
    from .launch.recover import recover
    from .layouts.leaves import FlatShard, Fused, Padded, PerRank, Replicated, ShardedTensor
    from .layouts.rules import fused_glu, fused_qkv, padded_vocab, replicated
    from .rng import RNGState
    from .tiers.memory import MemoryTier

# Public names, imported on first use: ``import unickpt`` (and ``unickpt --version``) stays
# light, torch is imported only when a name that needs it is used.
_MODULES = {
    ".api": ("async_save", "load", "prepare_staging", "save", "wait_pending"),
    ".checkpointer": ("Checkpointer",),
    ".config": ("Config", "get_config"),
    ".engine.futures": ("SaveFuture",),
    ".errors": (
        "CheckpointCorruptError",
        "CheckpointError",
        "CheckpointExistsError",
        "CheckpointLockedError",
        "CheckpointMismatchError",
        "CheckpointNotFoundError",
        "CheckpointVersionError",
        "DistributedCheckpointError",
        "MembershipChanged",
        "RecoveryError",
        "UnsafeObjectError",
    ),
    ".layouts.leaves": ("FlatShard", "Fused", "Padded", "PerRank", "Replicated", "ShardedTensor"),
    ".layouts.rules": ("fused_glu", "fused_qkv", "padded_vocab", "replicated"),
    ".tiers.memory": ("MemoryTier",),
    ".rng": ("RNGState",),
    ".launch.recover": ("recover",),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        try:  # a subpackage, as when importing unickpt imported them all (unickpt.storage)
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "Checkpointer",
    "Config",
    "DistributedCheckpointError",
    "FlatShard",
    "Fused",
    "MembershipChanged",
    "MemoryTier",
    "Padded",
    "PerRank",
    "RNGState",
    "RecoveryError",
    "Replicated",
    "SaveFuture",
    "ShardedTensor",
    "UnsafeObjectError",
    "async_save",
    "fused_glu",
    "fused_qkv",
    "get_config",
    "load",
    "padded_vocab",
    "prepare_staging",
    "recover",
    "replicated",
    "save",
    "wait_pending",
]
