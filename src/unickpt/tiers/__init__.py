"""Tiers beyond storage: checkpoints in the nodes' memory, replicas in peers' memory."""

from .memory import MemoryTier

__all__ = ["MemoryTier"]
