"""The systems the benchmark compares, behind one interface (:class:`CheckpointSystem`)."""

from __future__ import annotations

import importlib

from unickpt.bench.systems.base import CheckpointSystem, SaveHandle, Unsupported
from unickpt.bench.systems.registry import SYSTEMS_BY_NAME, SystemInfo

# name -> "module:Class"; imported only when the system runs.
_IMPLEMENTATIONS: dict[str, str] = {
    "unickpt": "unickpt.bench.systems.unickpt_systems:UnickptSystem",
    "unickpt-async": "unickpt.bench.systems.unickpt_systems:UnickptAsyncSystem",
    "unickpt-zero-stall": "unickpt.bench.systems.unickpt_systems:UnickptZeroStallSystem",
    "dcp": "unickpt.bench.systems.torch_systems:DcpSystem",
    "dcp-async-thread": "unickpt.bench.systems.torch_systems:DcpAsyncThreadSystem",
    "dcp-async-process": "unickpt.bench.systems.torch_systems:DcpAsyncProcessSystem",
    "torch-save": "unickpt.bench.systems.torch_systems:TorchSaveSystem",
    "bytecheckpoint": "unickpt.bench.systems.peer_bytecheckpoint:ByteCheckpointSystem",
    "dlrover": "unickpt.bench.systems.peer_dlrover:DlroverSystem",
    "megatron": "unickpt.bench.systems.peer_megatron:MegatronSystem",
    "torchsnapshot": "unickpt.bench.systems.peer_torchsnapshot:TorchSnapshotSystem",
}


def create_system(name: str) -> CheckpointSystem:
    """Instantiate a system by name; raises ImportError when its library is not installed."""
    info: SystemInfo = SYSTEMS_BY_NAME[name]
    module_name, class_name = _IMPLEMENTATIONS[name].split(":")
    importlib.import_module(info.module)
    cls = getattr(importlib.import_module(module_name), class_name)
    system: CheckpointSystem = cls(info)
    return system


__all__ = ["CheckpointSystem", "SaveHandle", "Unsupported", "create_system"]
