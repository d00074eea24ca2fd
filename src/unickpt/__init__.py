"""unickpt: one checkpoint format for every PyTorch parallel layout.

Save from any layout (single process, DDP, FSDP2, tensor parallel, explicit or flat shards),
load into any other world size or layout, fast and safely.

>>> import torch, unickpt
>>> model = torch.nn.Linear(4, 2)
>>> unickpt.save("/tmp/unickpt-doc/init", {"model": model}, overwrite=True)  # doctest: +SKIP
"""

from ._version import __version__ as __version__
from .api import async_save, load, save, wait_pending
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
    UnsafeObjectError,
)
from .layouts.leaves import FlatShard, PerRank, ShardedTensor
from .tiers.memory import MemoryTier

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
    "MemoryTier",
    "PerRank",
    "SaveFuture",
    "ShardedTensor",
    "UnsafeObjectError",
    "async_save",
    "get_config",
    "load",
    "save",
    "wait_pending",
]
