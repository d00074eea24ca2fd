"""Measure one system on one rank: save, the training iteration after it, load, reshard load.

Collective: every rank runs :func:`measure_system` with the same system at the same time, in a
fresh process (one run of one system per job), so no system starts with buffers another left.
Definitions (per rank; :mod:`unickpt.bench.results` folds ranks together):

* blocking: time inside the save call, plus the wait before the state may change
  (``wait_until_mutable``), plus, for systems whose next ``optimizer.step()`` waits for the save
  (zero-stall), what that step takes beyond its usual time;
* stall: the iteration that starts with the save (call, forward, backward, step) less the
  median of three plain iterations just before it, each at the slowest rank
  (:mod:`unickpt.bench.stall`): background copies and writes that compete with training for
  the cores count here;
* durable: from the save call until the checkpoint is committed and fsynced.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from unickpt.bench.measure import (
    PeakMemory,
    io_delta,
    now,
    settle,
    tree_io,
    tree_rss_bytes,
)
from unickpt.bench.model import TrainState
from unickpt.bench.results import RankMeasurement
from unickpt.bench.stall import plain_iteration_s, stall_s
from unickpt.bench.systems.base import CheckpointSystem, SaveHandle, Unsupported
from unickpt.bench.verify import Digest, mismatches, perturb, state_digest

log = logging.getLogger(__name__)

_PLAIN_ITERATIONS = 3


@dataclass(frozen=True)
class IterationBaseline:
    forward_backward_s: float
    step_s: float
    iteration_extra_bytes: int = 0  # resident memory one iteration adds (gradients, activations)


def measure_baseline(state: TrainState, repeats: int = 3) -> IterationBaseline:
    """Median time of forward+backward and of the optimizer step, without checkpointing."""
    fb: list[float] = []
    step: list[float] = []
    extra: list[int] = []
    for _ in range(repeats):
        settle()
        dist.barrier()
        with PeakMemory() as memory:
            t0 = now()
            state.forward_backward()
            state.synchronize()
            t1 = now()
            state.step()
            state.synchronize()
            step.append(now() - t1)
        fb.append(t1 - t0)
        extra.append(memory.extra_bytes)
    return IterationBaseline(
        statistics.median(fb), statistics.median(step), int(statistics.median(extra))
    )


@dataclass(frozen=True)
class _LoadPhase:
    values: dict[str, float]
    mismatches: int | None


def _remove(path: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


class _DurableWatch:
    """Waits for durability in a helper thread, so the time it is reached is known exactly
    while the training iteration runs."""

    def __init__(self, handle: SaveHandle) -> None:
        self._handle = handle
        self._error: BaseException | None = None
        self.done_at = 0.0
        self._thread = threading.Thread(target=self._wait, name="bench-durable", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        try:
            self._handle.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised by join()
            self._error = exc
        self.done_at = now()

    def join(self) -> float:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.done_at


def _save(
    system: CheckpointSystem,
    path: Path,
    state: TrainState,
    base: IterationBaseline,
    rss_before: int,
    plain_s: float,
) -> dict[str, float]:
    """One measured save, in the iteration it starts. Its memory is the peak resident memory
    above ``rss_before`` (taken before the system's first save, so buffers it keeps between
    saves count), during the call and, less what the training iteration needs itself, while
    the iteration overlaps it. ``plain_s``: an iteration without a save, just before."""
    gpu = state.device != "cpu"
    gpu_before = _gpu_reset() if gpu else 0
    settle()  # no collection due from earlier; the save's allocations cannot hide in freed pages
    before = tree_io()
    # One sampler for the whole iteration (as for the plain iterations), split between the
    # call and the overlap: nothing of the benchmark's own starts or stops inside the timing.
    with PeakMemory() as memory:
        dist.barrier()
        t0 = now()
        handle = system.save(path, state)
        handle.wait_until_mutable()
        t1 = now()
        call_peak = memory.split()
        watch = _DurableWatch(handle)
        state.forward_backward()
        state.synchronize()
        t2 = now()
        state.step()
        state.synchronize()
        t3 = now()
        durable_at = watch.join()
    moved = io_delta(before, tree_io())
    peak_extra = max(
        0,
        call_peak - rss_before,
        memory.peak_bytes - base.iteration_extra_bytes - rss_before,
    )
    step_wait = max(0.0, (t3 - t2) - base.step_s)
    values = {
        "blocking_s": (t1 - t0) + (step_wait if handle.step_waits else 0.0),
        "stall_s": stall_s(plain_s, t3 - t0),
        "step_wait_s": step_wait,
        "durable_s": durable_at - t0,
        "bytes_written": float(moved.write_bytes),
        "save_bytes_read": float(moved.rchar),
        "save_peak_extra_bytes": float(peak_extra),
    }
    if gpu:
        values["save_peak_gpu_bytes"] = float(torch.cuda.max_memory_allocated() - gpu_before)
    return values


def _gpu_reset() -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return int(torch.cuda.memory_allocated())


def _load(
    system: CheckpointSystem,
    path: Path,
    state: TrainState,
    expected: Digest,
    phase: str,
    errors: list[str],
) -> _LoadPhase:
    """Load and verify every element. A failure on any rank is agreed on before the
    (collective) check, so the ranks stay in step and the next phase can still run."""
    reshard = phase != "load"
    perturb(state)
    settle()
    dist.barrier()
    before = tree_io()
    error = ""
    with PeakMemory() as memory:
        t0 = now()
        try:
            system.bytes_read_reported = None
            (system.reshard_load if reshard else system.load)(path, state)
            state.synchronize()
        except Unsupported as exc:
            error = f"{phase}: not supported ({exc})"
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is one
            log.debug("%s failed:\n%s", phase, traceback.format_exc())
            error = f"{phase}: {describe(exc)}"
        seconds = now() - t0
    moved = io_delta(before, tree_io())
    if not _all_ranks_ok(not error):
        errors.append(error or f"{phase}: failed on another rank")
        return _LoadPhase({}, None)
    bad = mismatches(expected, state_digest(state))
    if bad:
        log.warning(
            "%s: %d tensors differ after %s, e.g. %s", system.info.name, len(bad), phase, bad[0]
        )
    if reshard:
        values = {
            "reshard_load_s": seconds,
            "reshard_bytes_read": float(moved.rchar),
            "reshard_peak_extra_bytes": float(memory.extra_bytes),
        }
        if system.bytes_read_reported is not None:
            values["reshard_bytes_reported"] = float(system.bytes_read_reported)
    else:
        values = {
            "load_s": seconds,
            "load_bytes_read": float(moved.rchar),
            "load_bytes_read_device": float(moved.read_bytes),
            "load_peak_extra_bytes": float(memory.extra_bytes),
        }
    return _LoadPhase(values, len(bad))


def _extra(
    system: CheckpointSystem, path: Path, state: TrainState, errors: list[str]
) -> dict[str, float]:
    """The system's own measures; a failure on any rank drops them on every rank."""
    error = ""
    extra: dict[str, float] = {}
    try:
        extra = system.extra_measures(path, state)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - recorded in the row's message
        log.debug("extra measures failed:\n%s", traceback.format_exc())
        error = f"extra measures: {describe(exc)}"
    if not _all_ranks_ok(not error):
        errors.append(error or "extra measures: failed on another rank")
        return {}
    return extra


def describe(exc: BaseException, limit: int = 300) -> str:
    """The exception's type and its last meaningful line (DCP wraps every rank's traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _all_ranks_ok(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _first_save(system: CheckpointSystem, path: Path, state: TrainState) -> float:
    dist.barrier()
    t0 = now()
    handle = system.save(path, state)
    handle.wait_until_mutable()
    handle.wait()
    elapsed = now() - t0
    _remove(path)
    return elapsed


def measure_system(
    system: CheckpointSystem,
    workdir: Path,
    state: TrainState,
    reshard_state: TrainState,
    base: IterationBaseline,
    warmup: bool,
) -> RankMeasurement:
    """Run every phase for ``system``; phases the system cannot do are recorded as errors."""
    errors: list[str] = []
    settle()  # the level counts live memory only (see measure.settle)
    rss_before = tree_rss_bytes()
    values: dict[str, float] = {}
    if warmup:
        values["first_durable_s"] = _first_save(
            system, workdir / f"{system.info.name}-warmup", state
        )
    # The stall's reference, right before the save: the median of a few plain iterations,
    # each started as the save's iteration is (settled) and timed while the same memory
    # sampler runs (the benchmark's own costs are on both sides, not in the stall).
    with PeakMemory():
        plain_s = plain_iteration_s(state, _PLAIN_ITERATIONS, prepare=settle)
    expected = state_digest(state)
    path = workdir / system.info.name
    values.update(_save(system, path, state, base, rss_before, plain_s))
    dist.barrier()
    found: dict[str, int | None] = {}
    for phase, target in (("load", state), ("reshard load", reshard_state)):
        loaded = _load(system, path, target, expected, phase, errors)
        values.update(loaded.values)
        found[phase] = loaded.mismatches
    values.update(_extra(system, path, state, errors))
    _remove(path)
    return RankMeasurement(values, found, tuple(errors))
