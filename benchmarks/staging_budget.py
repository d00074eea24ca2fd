"""Asynchronous saves within a host-memory budget: peak extra memory and stall per save.

Builds the benchmark's GPT with AdamW, sharded with FSDP2 over ``--world`` CPU processes (gloo),
and for each system runs ``--rounds`` iterations that start with an asynchronous save (each save
waited for before the next round, outside the timing) against plain iterations just before:

- ``unickpt`` ``async_save`` with ``staging_bytes`` of 1x (the whole state fits), 1/4 and 1/16
  of a rank's state, the call blocking until the snapshot is done ("call" mode), and the same
  budgets with ``zero_stall=True`` (zero-stall: the next optimizer step waits);
- ``dcp`` ``torch.distributed.checkpoint.async_save`` (thread executor, its default stager);
- ``torchsnapshot`` ``Snapshot.async_take`` with its per-rank memory budget at 1/4 of the state
  (when it is installed; it takes each rank's local shards of the model and the optimizer).

Peak extra memory is measured apart, over saves waited for at once (no training meanwhile, so
activations do not count): the rank's resident high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` before the first save of a system) less its resident memory before,
the largest rank counting; it includes staging memory kept between saves. The stall is the save
iteration's time less the plain iteration's, the slowest rank counting. Medians over the rounds.

python benchmarks/staging_budget.py --params 100M --world 2 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _ranks import run_world

import unickpt
from unickpt.bench.config import parse_param_count
from unickpt.bench.model import TrainState, build_train_state, config_for_params
from unickpt.bench.stall import plain_iteration_s, slowest, stall_s
from unickpt.saving.queue import QUEUE

MiB = 1 << 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _state_bytes(state: TrainState) -> int:
    total = 0
    for t in list(state.model.state_dict().values()) + [
        v for s in state.optimizer.state.values() for v in s.values()
    ]:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.nbytes
    return total


Saver = Callable[[str, TrainState], Any]


def _unickpt(budget: int | None, background: bool) -> Saver:
    def save(path: str, state: TrainState) -> Any:
        return unickpt.async_save(
            path,
            state.state(),
            overwrite=True,
            staging_bytes=budget,
            zero_stall=background,
        )

    return save


def _dcp(group: Any) -> Saver:
    import torch.distributed.checkpoint as dcp

    from unickpt.bench.systems.torch_systems import sharded_state_dict

    def save(path: str, state: TrainState) -> Any:
        return dcp.async_save(sharded_state_dict(state), checkpoint_id=path, process_group=group)

    return save


def _torchsnapshot(budget: int) -> Saver | None:
    try:
        import torchsnapshot
    except ImportError:
        return None
    os.environ["TORCHSNAPSHOT_PER_RANK_MEMORY_BUDGET_BYTES"] = str(budget)

    def save(path: str, state: TrainState) -> Any:
        local: dict[str, torch.Tensor] = {}  # torchsnapshot takes no DTensor: local shards
        for name, p in state.model.named_parameters():
            local[f"model.{name}"] = _local(p.data)
            for key, value in state.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    local[f"optimizer.{name}.{key}"] = _local(value)
        holder = torchsnapshot.StateDict(**local)
        return torchsnapshot.Snapshot.async_take(path, {"s": holder})

    return save


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _wait(handle: Any) -> None:
    for name in ("wait", "result"):
        fn = getattr(handle, name, None)
        if callable(fn):
            fn()
            return


def _systems(state_bytes: int, group: Any) -> list[tuple[str, Saver | None]]:
    out: list[tuple[str, Saver | None]] = []
    for background in (False, True):
        mode = "zero-stall" if background else "call"
        for label, budget in (("1x", None), ("1/4", state_bytes // 4), ("1/16", state_bytes // 16)):
            out.append((f"unickpt {mode} {label}", _unickpt(budget, background)))
    out.append(("dcp async", _dcp(group)))
    out.append(("torchsnapshot 1/4", _torchsnapshot(state_bytes // 4)))
    return out


def _peak_extra(saver: Saver, state: TrainState, path: str, rounds: int) -> float:
    """Collective: the largest rank's resident high-water mark over ``rounds`` saves, each
    waited for at once (no training meanwhile), less its resident memory before the first."""
    QUEUE.arena.release()
    gc.collect()
    dist.barrier()
    rss0 = _status("VmRSS")
    _reset_peak()
    for r in range(rounds):
        _wait(saver(f"{path}-{r}", state))
        dist.barrier()
    return slowest(float(_status("VmHWM") - rss0))


def _rank(rank: int, world: int, args: argparse.Namespace, q: Any) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, args.threads))
    state = build_train_state(config_for_params(parse_param_count(args.params)), "shard0", 256)
    group = dist.new_group(backend="gloo")
    nbytes = _state_bytes(state)
    results: dict[str, Any] = {"state_bytes_per_rank": int(slowest(float(nbytes)))}
    for name, saver in _systems(nbytes, group):
        if args.systems and not any(name.startswith(p) for p in args.systems.split(",")):
            continue
        if saver is None:
            results[name] = "not installed"
            continue
        peak = _peak_extra(saver, state, f"{args.workdir}/mem", args.rounds)
        stalls, calls = [], []
        for r in range(args.rounds):
            plain = plain_iteration_s(state)
            dist.barrier()
            t0 = time.perf_counter()
            handle = saver(f"{args.workdir}/{name.replace(' ', '_').replace('/', '-')}-{r}", state)
            call = time.perf_counter() - t0
            state.forward_backward()
            state.step()
            stalls.append(stall_s(plain, time.perf_counter() - t0))
            calls.append(slowest(call))
            _wait(handle)
            dist.barrier()
        results[name] = {
            "stall_s": round(statistics.median(stalls), 4),
            "call_s": round(statistics.median(calls), 4),
            "peak_extra_MiB": round(peak / MiB, 1),
        }
        if rank == 0:
            shutil.rmtree(args.workdir, ignore_errors=True)
        dist.barrier()
    if rank == 0:
        q.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="100M")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--systems", default="", help="comma-separated name prefixes to run (default: all)"
    )
    parser.add_argument("--workdir", default=None, help="checkpoint folder (default: a temp one)")
    args = parser.parse_args(argv)
    own = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="unickpt-staging-")
    # A fixed threshold: every large buffer is its own mapping, returned to the system when
    # freed, so one system's freed staging memory does not hide the next one's.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    results = run_world(args.world, _rank, args)
    if own:
        shutil.rmtree(args.workdir, ignore_errors=True)
    out = {"params": args.params, "world": args.world, "rounds": args.rounds, **results}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
