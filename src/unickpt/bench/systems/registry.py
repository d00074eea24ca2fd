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
    ``impl`` names the :class:`~unickpt.bench.systems.base.CheckpointSystem` subclass as
    ``"package.module:Class"``; it is imported only in the job that runs the system.
    """

    name: str
    label: str
    module: str
    peer: bool
    description: str
    impl: str


_PKG = "unickpt.bench.systems"

SYSTEM_INFOS: tuple[SystemInfo, ...] = (
    SystemInfo(
        "unickpt",
        "unickpt save",
        "unickpt",
        False,
        "unickpt.save, synchronous, durable",
        f"{_PKG}.unickpt_systems:UnickptSystem",
    ),
    SystemInfo(
        "unickpt-async",
        "unickpt async_save",
        "unickpt",
        False,
        "unickpt.async_save; blocking ends at wait_snapshot()",
        f"{_PKG}.unickpt_systems:UnickptAsyncSystem",
    ),
    SystemInfo(
        "unickpt-zero-stall",
        "unickpt zero-stall",
        "unickpt",
        False,
        "async_save(zero_stall=True); blocking = call + wait in next optimizer.step",
        f"{_PKG}.unickpt_systems:UnickptZeroStallSystem",
    ),
    SystemInfo(
        "dcp",
        "DCP save",
        "torch",
        False,
        "torch.distributed.checkpoint.save, writer threads = unickpt's, plan caching",
        f"{_PKG}.torch_systems:DcpSystem",
    ),
    SystemInfo(
        "dcp-async-thread",
        "DCP async (thread)",
        "torch",
        False,
        "dcp.async_save, thread executor, reused DefaultStager (pinned + async on CUDA)",
        f"{_PKG}.torch_systems:DcpAsyncThreadSystem",
    ),
    SystemInfo(
        "dcp-async-process",
        "DCP async (process)",
        "torch",
        False,
        "dcp.async_save, process executor, DefaultStager(pinned + shared memory)",
        f"{_PKG}.torch_systems:DcpAsyncProcessSystem",
    ),
    SystemInfo(
        "torch-save",
        "torch.save (rank 0, full)",
        "torch",
        False,
        "full state gathered to rank 0, torch.save + fsync; load broadcasts from rank 0",
        f"{_PKG}.torch_systems:TorchSaveSystem",
    ),
    SystemInfo(
        "bytecheckpoint",
        "ByteCheckpoint 0.0.2",
        "bytecheckpoint",
        True,
        "bytecheckpoint.save/load, framework fsdp2, fast_saving/fast_loading",
        f"{_PKG}.peer_bytecheckpoint:ByteCheckpointSystem",
    ),
    SystemInfo(
        "dlrover",
        "DLRover flash 0.6.1",
        "dlrover.trainer.torch.flash_checkpoint",
        True,
        "flash checkpoint to memory then disk",
        f"{_PKG}.peer_dlrover:DlroverSystem",
    ),
    SystemInfo(
        "megatron",
        "Megatron-Core 0.16.1",
        "megatron.core.dist_checkpointing",
        True,
        "dist_checkpointing torch_dist backend, writer threads = unickpt's, cached metadata",
        f"{_PKG}.peer_megatron:MegatronSystem",
    ),
    SystemInfo(
        "torchsnapshot",
        "torchsnapshot 0.1.0",
        "torchsnapshot",
        True,
        "Snapshot.take / restore of each rank's local shards",
        f"{_PKG}.peer_torchsnapshot:TorchSnapshotSystem",
    ),
)

SYSTEMS_BY_NAME: dict[str, SystemInfo] = {info.name: info for info in SYSTEM_INFOS}
ALL_SYSTEMS: tuple[str, ...] = tuple(info.name for info in SYSTEM_INFOS)
PEER_SYSTEMS: tuple[str, ...] = tuple(info.name for info in SYSTEM_INFOS if info.peer)
DEFAULT_SYSTEMS: tuple[str, ...] = ALL_SYSTEMS
BASELINE_SYSTEM = "dcp"
