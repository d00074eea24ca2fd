"""The training stall of a checkpoint: how much longer an iteration with a save takes than one
without.

An iteration is forward, backward and ``optimizer.step()``; the one with a save starts with the
save call (and the wait before the state may change) and ends when its step returns. Ranks step
together, so each iteration counts at its slowest rank. The stall is the save iteration's time
less the plain iteration's (or the median of a few) taken just before it: for a synchronous
save about the save itself; for a background save the call, the wait inside the step, and the
time the background copies and writes take from forward and backward by competing for the
same cores. Collective: every rank calls these functions at the same point.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from unickpt.bench.measure import now
from unickpt.bench.model import TrainState


def slowest(value: float) -> float:
    """Collective: the largest ``value`` of any rank."""
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def iteration_s(state: TrainState) -> float:
    """This rank's time for one forward, backward and optimizer step (device work included)."""
    t0 = now()
    state.forward_backward()
    state.step()
    state.synchronize()
    return now() - t0


def plain_iteration_s(
    state: TrainState, repeats: int = 1, prepare: Callable[[], object] | None = None
) -> float:
    """Collective: an iteration without a save, timed at the slowest rank; with ``repeats``
    above 1, the median of that many such iterations (one slow spell of a shared machine does
    not become the reference). ``prepare`` runs before each, untimed: what the caller also
    does before the save's iteration, so both start alike."""
    times: list[float] = []
    for _ in range(repeats):
        if prepare is not None:
            prepare()
        dist.barrier()
        times.append(slowest(iteration_s(state)))
    return statistics.median(times)


def stall_s(plain_s: float, save_iteration_s: float) -> float:
    """Collective: this rank's save iteration (``save_iteration_s``) taken at the slowest rank,
    less the slowest plain iteration ``plain_s`` from :func:`plain_iteration_s`."""
    return slowest(save_iteration_s) - plain_s
