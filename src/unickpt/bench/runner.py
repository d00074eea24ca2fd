"""Measure one system on one rank: save, the training iteration after it, load, reshard load.

Collective: every rank runs :func:`measure_system` with the same system at the same time.
Definitions (per rank; :mod:`unickpt.bench.results` folds ranks together):

* blocking: time inside the save call, plus the wait before the state may change
  (``wait_until_mutable``), plus, for systems whose next ``optimizer.step()`` waits for the save
  (zero-stall), what that step takes beyond its usual time;
* iteration slowdown: how much longer the forward, backward and step right after the save take
  than usual (background copies and writes compete for the same cores);
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

from unickpt.bench.measure import PeakMemory, io_delta, now, tree_io, tree_rss_bytes
from unickpt.bench.model import TrainState
from unickpt.bench.results import RankMeasurement
from unickpt.bench.systems.base import CheckpointSystem, SaveHandle, Unsupported
from unickpt.bench.verify import Fingerprint, fingerprint, mismatches, perturb

log = logging.getLogger(__name__)


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
        dist.barrier()
        with PeakMemory() as memory:
            t0 = now()
            state.forward_backward()
            t1 = now()
            state.step()
            step.append(now() - t1)
        fb.append(t1 - t0)
        extra.append(memory.extra_bytes)
    return IterationBaseline(
        statistics.median(fb), statistics.median(step), int(statistics.median(extra))
    )


@dataclass(frozen=True)
class _SavePhase:
    blocking_s: float
    step_wait_s: float
    slowdown_s: float
    durable_s: float
    write_bytes: int
    rchar: int
    peak_extra_bytes: int


@dataclass(frozen=True)
class _LoadPhase:
    seconds: float | None
    rchar: int
    read_bytes: int
    peak_extra_bytes: int
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
) -> _SavePhase:
    """One measured save. Its memory is the peak resident memory above ``rss_before`` (taken
    before the system's first save, so buffers it keeps between saves count), during the call
    and, less what the training iteration needs itself, while the iteration overlaps it."""
    dist.barrier()
    before = tree_io()
    with PeakMemory() as call_memory:
        t0 = now()
        handle = system.save(path, state)
        handle.wait_until_mutable()
        t1 = now()
    with PeakMemory() as overlap_memory:
        watch = _DurableWatch(handle)
        state.forward_backward()
        t2 = now()
        state.step()
        t3 = now()
        durable_at = watch.join()
    moved = io_delta(before, tree_io())
    peak_extra = max(
        0,
        call_memory.peak_bytes - rss_before,
        overlap_memory.peak_bytes - base.iteration_extra_bytes - rss_before,
    )
    step_wait = max(0.0, (t3 - t2) - base.step_s)
    slowdown = (t3 - t1) - (base.forward_backward_s + base.step_s)
    return _SavePhase(
        blocking_s=(t1 - t0) + (step_wait if handle.step_waits else 0.0),
        step_wait_s=step_wait,
        slowdown_s=slowdown,
        durable_s=durable_at - t0,
        write_bytes=moved.write_bytes,
        rchar=moved.rchar,
        peak_extra_bytes=peak_extra,
    )


def _load(
    system: CheckpointSystem,
    path: Path,
    state: TrainState,
    expected: Fingerprint,
    reshard: bool,
    errors: list[str],
) -> _LoadPhase:
    """Load and verify. A failure on any rank is agreed on before the (collective) check, so
    the ranks stay in step and the next system can still run."""
    what = "reshard load" if reshard else "load"
    perturb(state)
    dist.barrier()
    before = tree_io()
    error = ""
    with PeakMemory() as memory:
        t0 = now()
        try:
            (system.reshard_load if reshard else system.load)(path, state)
        except Unsupported as exc:
            error = f"{what}: not supported ({exc})"
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is one
            log.debug("%s failed:\n%s", what, traceback.format_exc())
            error = f"{what}: {describe(exc)}"
        seconds = now() - t0
    moved = io_delta(before, tree_io())
    if not _all_ranks_ok(not error):
        errors.append(error or f"{what}: failed on another rank")
        return _LoadPhase(None, 0, 0, 0, None)
    bad = mismatches(expected, fingerprint(state))
    if bad:
        log.warning(
            "%s: %d tensors differ after %s, e.g. %s", system.info.name, len(bad), what, bad[0]
        )
    return _LoadPhase(seconds, moved.rchar, moved.read_bytes, memory.extra_bytes, len(bad))


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
    rss_before = tree_rss_bytes()
    first = _first_save(system, workdir / f"{system.info.name}-warmup", state) if warmup else None
    expected = fingerprint(state)
    path = workdir / system.info.name
    save = _save(system, path, state, base, rss_before)
    dist.barrier()
    loaded = _load(system, path, state, expected, False, errors)
    resharded = _load(system, path, reshard_state, expected, True, errors)
    _remove(path)
    return RankMeasurement(
        first_durable_s=first,
        blocking_s=save.blocking_s,
        step_wait_s=save.step_wait_s,
        iteration_slowdown_s=save.slowdown_s,
        durable_s=save.durable_s,
        save_write_bytes=save.write_bytes,
        save_rchar=save.rchar,
        save_peak_extra_bytes=save.peak_extra_bytes,
        load_s=loaded.seconds,
        load_rchar=loaded.rchar,
        load_read_bytes=loaded.read_bytes,
        load_peak_extra_bytes=loaded.peak_extra_bytes,
        load_mismatches=loaded.mismatches,
        reshard_s=resharded.seconds,
        reshard_rchar=resharded.rchar,
        reshard_peak_extra_bytes=resharded.peak_extra_bytes,
        reshard_mismatches=resharded.mismatches,
        errors=tuple(errors),
    )
