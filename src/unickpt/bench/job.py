"""One benchmark job: start the ranks, build the state, then measure the hardware or one run of
one system.

Run by the harness as ``python -m unickpt.bench.job ...`` (with the peers' interpreter for the
peer systems), once per run, so every run starts in fresh processes. Rank 0 appends one JSON
object per line to ``--results`` as soon as each part is measured::

    {"kind": "info", ...}      state size and model shape
    {"kind": "hardware", ...}  see unickpt.bench.hardware
    {"kind": "run", "name": ..., "notes": ..., "run": {...}}   one RunResult
    {"kind": "failed", "name": ..., "status": ..., "message": ..., "notes": ...}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unickpt.bench.config import DEVICES
from unickpt.bench.hardware import measure_hardware
from unickpt.bench.model import (
    GPTConfig,
    TrainState,
    build_train_state,
    config_for_params,
    local_state_bytes,
)
from unickpt.bench.ranks import free_port
from unickpt.bench.results import STATUS_ERROR, STATUS_NOT_INSTALLED, RankMeasurement, combine
from unickpt.bench.runner import IterationBaseline, describe, measure_baseline, measure_system
from unickpt.bench.systems import CheckpointSystem, create_system

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m unickpt.bench.job")
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--system", default="", help="the system to run once (none: no run)")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hardware", action="store_true")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


class _Results:
    """Rank 0's writer of the results file; a no-op on the other ranks."""

    def __init__(self, path: Path) -> None:
        self._path = path if dist.get_rank() == 0 else None

    def write(self, kind: str, payload: dict[str, Any]) -> None:
        if self._path is None:
            return
        with self._path.open("a") as handle:
            handle.write(json.dumps({"kind": kind, **payload}) + "\n")


def _agree(ok: bool, message: str) -> str:
    """Collective: the first non-empty failure message of any rank, or "" when all succeeded."""
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, "" if ok else message or "failed")
    return next((m for m in messages if m), "")


def _create(name: str) -> tuple[CheckpointSystem | None, str, str]:
    try:
        return create_system(name), "", ""
    except ImportError as exc:
        return None, STATUS_NOT_INSTALLED, str(exc)
    except Exception as exc:  # noqa: BLE001 - recorded as this system's error row
        return None, STATUS_ERROR, describe(exc)


def _run_system(
    name: str,
    args: argparse.Namespace,
    state: TrainState,
    reshard: TrainState,
    base: IterationBaseline,
    results: _Results,
) -> None:
    system, status, message = _create(name)
    failure = _agree(system is not None, f"{status}|{message}")
    if failure:
        status, _, message = failure.partition("|")
        results.write("failed", {"name": name, "status": status, "message": message})
        return
    assert system is not None
    measurement: RankMeasurement | None = None
    error = ""
    try:
        measurement = measure_system(system, args.workdir, state, reshard, base, not args.no_warmup)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        log.error("%s failed on rank %d:\n%s", name, dist.get_rank(), traceback.format_exc())
        error = describe(exc)
    finally:
        system.close()
    failure = _agree(measurement is not None, error)
    if failure:
        payload = {"name": name, "status": STATUS_ERROR, "message": failure}
        results.write("failed", {**payload, "notes": system.notes})
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, measurement)
    run = combine(gathered)
    results.write("run", {"name": name, "notes": system.notes, "run": dataclasses.asdict(run)})


def _init_process_group(rank: int, args: argparse.Namespace) -> None:
    """gloo on CPU; on CUDA, one device per rank and NCCL beside gloo (DCP's asynchronous
    saves need a CPU backend)."""
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=args.world)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=args.world)


def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(args.world))
    torch.set_num_threads(1)
    _init_process_group(rank, args)
    try:
        _run_rank(args)
    finally:
        dist.destroy_process_group()


def _run_rank(args: argparse.Namespace) -> None:
    results = _Results(args.results)
    config: GPTConfig = config_for_params(args.params)
    state = build_train_state(config, "shard0", args.seq_len, args.device)
    sizes = torch.tensor([local_state_bytes(state)], dtype=torch.int64)
    dist.all_reduce(sizes)
    results.write(
        "info",
        {
            "state_bytes": int(sizes.item()),
            "params": config.param_count,
            "model": dataclasses.asdict(config),
        },
    )
    if args.hardware:
        hardware = measure_hardware(args.workdir, local_state_bytes(state), args.device)
        results.write("hardware", hardware.to_dict())
    if not args.system:
        return
    reshard = build_train_state(config, "shard1", args.seq_len, args.device)
    base = measure_baseline(state)
    log.info("iteration baseline: %s; running %s", base, args.system)
    _run_system(args.system, args, state, reshard, base, results)


def _import_for_ranks() -> None:
    """Import what every rank imports to build its state (FSDP2, DTensor and the device mesh,
    a CPU second or more), once here before the ranks are forked instead of once in each."""
    import torch.distributed.device_mesh
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    _import_for_ranks()
    # fork: the ranks start from this process, which imported torch but ran nothing (no
    # threads, no CUDA context), instead of importing everything again each.
    mp.start_processes(_rank_main, args=(args, free_port()), nprocs=args.world, start_method="fork")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
