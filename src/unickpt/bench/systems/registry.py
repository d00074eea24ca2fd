"""Names of the systems the benchmark knows, and where each one runs.

This module only names things; it imports no checkpointing library, so the CLI can list
systems and validate ``--systems`` without any of them installed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SystemInfo:
    """One benchmarked system.

    ``module`` is the Python module that must import for the system to run; ``peer`` systems
    run in the separate peers environment, the others in the benchmark's own interpreter.
    """

    name: str
    label: str
    module: str
    peer: bool
    description: str


SYSTEM_INFOS: tuple[SystemInfo, ...] = (
    SystemInfo("unickpt", "unickpt save", "unickpt", False, "unickpt.save, synchronous, durable"),
    SystemInfo(
        "unickpt-async",
        "unickpt async_save",
        "unickpt",
        False,
        "unickpt.async_save; blocking ends at wait_snapshot()",
    ),
    SystemInfo(
        "unickpt-zero-stall",
        "unickpt zero-stall",
        "unickpt",
        False,
        "async_save(background_snapshot=True); blocking = call + wait in next optimizer.step",
    ),
    SystemInfo("dcp", "DCP save", "torch", False, "torch.distributed.checkpoint.save"),
    SystemInfo(
        "dcp-async-thread",
        "DCP async (thread)",
        "torch",
        False,
        "dcp.async_save, thread executor, default stager",
    ),
    SystemInfo(
        "dcp-async-process",
        "DCP async (process)",
        "torch",
        False,
        "dcp.async_save, process executor, DefaultStager(pinned + shared memory)",
    ),
    SystemInfo(
        "torch-save",
        "torch.save (rank 0, full)",
        "torch",
        False,
        "full state gathered to rank 0, torch.save + fsync; load broadcasts from rank 0",
    ),
    SystemInfo(
        "bytecheckpoint",
        "ByteCheckpoint 0.0.2",
        "bytecheckpoint",
        True,
        "bytecheckpoint.save/load, framework fsdp2, fast_saving/fast_loading",
    ),
    SystemInfo(
        "dlrover",
        "DLRover flash 0.6.1",
        "dlrover.trainer.torch.flash_checkpoint",
        True,
        "flash checkpoint to memory then disk",
    ),
    SystemInfo(
        "megatron",
        "Megatron-Core 0.16.1",
        "megatron.core.dist_checkpointing",
        True,
        "dist_checkpointing torch_dist backend, fully parallel save",
    ),
    SystemInfo(
        "torchsnapshot",
        "torchsnapshot 0.1.0",
        "torchsnapshot",
        True,
        "Snapshot.take / restore of each rank's local shards",
    ),
)

SYSTEMS_BY_NAME: dict[str, SystemInfo] = {info.name: info for info in SYSTEM_INFOS}
ALL_SYSTEMS: tuple[str, ...] = tuple(info.name for info in SYSTEM_INFOS)
PEER_SYSTEMS: tuple[str, ...] = tuple(info.name for info in SYSTEM_INFOS if info.peer)
DEFAULT_SYSTEMS: tuple[str, ...] = ALL_SYSTEMS
BASELINE_SYSTEM = "dcp"
