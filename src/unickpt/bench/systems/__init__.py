"""The systems the benchmark compares, behind one interface (:class:`CheckpointSystem`).

Adding a system: write a :class:`CheckpointSystem` subclass in a module of this package and
add one :class:`SystemInfo` to ``registry.SYSTEM_INFOS`` naming it (``impl``).
"""

from __future__ import annotations

import importlib

from unickpt.bench.systems.base import CheckpointSystem, SaveHandle, Unsupported
from unickpt.bench.systems.registry import SYSTEMS_BY_NAME, SystemInfo


def create_system(name: str) -> CheckpointSystem:
    """Instantiate a system by name; raises ImportError when its library is not installed."""
    info: SystemInfo = SYSTEMS_BY_NAME[name]
    module_name, class_name = info.impl.split(":")
    importlib.import_module(info.module)
    cls = getattr(importlib.import_module(module_name), class_name)
    system: CheckpointSystem = cls(info)
    return system


__all__ = ["CheckpointSystem", "SaveHandle", "Unsupported", "create_system"]
