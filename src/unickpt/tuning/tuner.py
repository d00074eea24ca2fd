"""The interval tuner: measures steps and saves, and says at which steps to save.

Driven by an injectable clock and nothing else (no I/O), so that it is tested with a fake
clock and made-up costs. The loop calls :meth:`IntervalTuner.begin` at the start of every
``maybe_save`` and :meth:`IntervalTuner.end` once the call is over:

- a step's time is the time between the end of one call and the start of the next;
- a save's cost to the loop is its stall (the time the call took) plus the slowdown of the
  steps that ran while its background work was in flight, each against the median time of
  recent steps that overlapped no save; it is recorded at the first step (or reading of
  :attr:`IntervalTuner.tuning`) that finds the background work done, or at the next save;
- after each save the interval is chosen again (:func:`choose_interval`) from the median cost
  of the last three saves (the newest one's slowdown not yet known, the previous one's taken in
  its place), so a save that becomes cheap (a memory tier) shortens the interval within two
  saves. Ranks agree on it through ``agree`` (every rank then saves at the same steps).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CheckpointError
from .interval import choose_interval, overhead

log = logging.getLogger(__name__)

_COSTS_KEPT = 3
_DECISIONS_KEPT = 100


@dataclass(frozen=True)
class SaveCost:
    """What one save cost the loop: the stall in the call plus the slowdown of the steps that
    overlapped its background work."""

    step: int
    stall_s: float
    slowdown_s: float

    @property
    def total_s(self) -> float:
        return self.stall_s + self.slowdown_s


@dataclass(frozen=True)
class Decision:
    """An interval chosen at ``step`` (the next save is at ``step + every``) and why."""

    step: int
    every: int
    reason: str
    save_cost_s: float | None
    step_s: float | None
    mtbf_s: float | None


@dataclass(frozen=True)
class Tuning:
    """What the tuner measured and decided (``Checkpointer.tuning``)."""

    mode: str
    every: int | None
    next_save_step: int | None
    step_s: float | None
    save_cost_s: float | None
    overhead: float | None
    max_overhead: float
    mtbf_s: float | None
    mtbf_source: str | None
    reason: str
    saves: int
    costs: tuple[SaveCost, ...]
    decisions: tuple[Decision, ...]


def _identity(every: int) -> int:
    return every


class IntervalTuner:
    """Chooses the steps to save at: every ``every`` steps, or ``"auto"``.

    ``agree(every)`` returns the interval every rank adopts (for example the largest any rank
    proposes); it is called on every rank at the same steps.

    >>> tuner = IntervalTuner("auto", max_overhead=0.01)
    >>> tuner.begin(0)
    False
    """

    def __init__(
        self,
        every: int | str,
        max_overhead: float = 0.01,
        mtbf_s: float | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        agree: Callable[[int], int] = _identity,
        warmup_steps: int = 3,
        window: int = 16,
    ) -> None:
        if every != "auto" and not (isinstance(every, int) and every >= 1):
            raise CheckpointError(
                f"every is {every!r}; expected 'auto' or a positive number of steps."
            )
        if not 0.0 < max_overhead < 1.0:
            raise CheckpointError(
                f"max_overhead is {max_overhead}; expected a fraction between 0 and 1 (0.01 "
                "allows saving to cost 1% of the loop's time)."
            )
        if mtbf_s is not None and mtbf_s <= 0.0:
            raise CheckpointError(f"mtbf_s is {mtbf_s}; expected None or a positive time.")
        self.auto = every == "auto"
        self.fixed_every = every if isinstance(every, int) else None
        self.max_overhead = max_overhead
        self.mtbf_s = mtbf_s
        self.mtbf_source = "given" if mtbf_s is not None else None
        self.clock = clock
        self.agree = agree
        self.warmup_steps = warmup_steps
        self._clean: deque[float] = deque(maxlen=window)
        self._recent: deque[float] = deque(maxlen=window)
        self._costs: deque[SaveCost] = deque(maxlen=_COSTS_KEPT)
        self._decisions: deque[Decision] = deque(maxlen=_DECISIONS_KEPT)
        self._every: int | None = self.fixed_every
        self._next: int | None = None
        self._reason = "fixed interval" if self.fixed_every else "measuring the step time"
        self._saves = 0
        self._started: float | None = None
        self._last_end: float | None = None
        self._pending: tuple[int, float, Callable[[], bool]] | None = None
        self._slowdown = 0.0

    def learn_mtbf(self, mtbf_s: float | None) -> None:
        """A mean time between failures learnt from restarts; a given one takes precedence."""
        if self.mtbf_source != "given" and mtbf_s is not None and mtbf_s > 0.0:
            self.mtbf_s, self.mtbf_source = mtbf_s, "learnt from restarts"

    def begin(self, step: int) -> bool:
        """Account the step that just ended; whether to save at ``step``."""
        now = self.clock()
        self._started = now
        if self._last_end is not None:
            self._account_step(now - self._last_end)
        if self.fixed_every is not None:
            return step % self.fixed_every == 0
        if self._next is None:
            self._next = step + self.warmup_steps
        return step >= self._next

    def end(self, step: int, saved: bool, done: Callable[[], bool] | None = None) -> None:
        """The call for ``step`` is over; ``done()`` tells whether its save's background work
        has finished (None: the save was synchronous)."""
        now = self.clock()
        if saved and self._started is not None:
            self._finish_pending()
            stall = now - self._started
            self._saves += 1
            self._pending = (step, stall, done or (lambda: True))
            self._slowdown = 0.0
            if self.auto:
                self._decide(step, stall)
                now = self.clock()  # agreeing may take a collective: not the next step's time
        self._last_end = now

    @property
    def tuning(self) -> Tuning:
        """What was measured and decided. A save whose background work has finished since the
        last step is accounted now; one still in flight counts with its stall (as when the
        interval is chosen), so a loop that saved has a save cost whatever the timing."""
        if self._pending is not None and self._pending[2]():
            self._finish_pending()
        step_s = self.step_s()
        cost = self._cost_estimate(self._pending[1] if self._pending is not None else None)
        every = self._every
        return Tuning(
            mode="auto" if self.auto else "fixed",
            every=every,
            next_save_step=self._next if self.auto else None,
            step_s=step_s,
            save_cost_s=cost,
            overhead=(
                overhead(cost, step_s, every)
                if cost is not None and step_s is not None and every
                else None
            ),
            max_overhead=self.max_overhead,
            mtbf_s=self.mtbf_s,
            mtbf_source=self.mtbf_source,
            reason=self._reason,
            saves=self._saves,
            costs=tuple(self._costs),
            decisions=tuple(self._decisions),
        )

    def step_s(self) -> float | None:
        """The median time of recent steps that overlapped no save (any steps when none)."""
        source = self._clean or self._recent
        return statistics.median(source) if source else None

    def _account_step(self, step_s: float) -> None:
        self._recent.append(step_s)
        if self._pending is None:
            self._clean.append(step_s)
            return
        base = self.step_s()
        self._slowdown += max(0.0, step_s - base) if base is not None else 0.0
        if self._pending[2]():
            self._finish_pending()

    def _finish_pending(self) -> None:
        if self._pending is not None:
            step, stall, _ = self._pending
            self._costs.append(SaveCost(step, stall, self._slowdown))
            self._pending, self._slowdown = None, 0.0

    def _cost_estimate(self, stall_s: float | None = None) -> float | None:
        """The median of the last saves' costs; a save still in flight counts with its stall
        plus the slowdown measured for the save before it."""
        totals = [c.total_s for c in self._costs]
        if stall_s is not None:
            previous = self._costs[-1].slowdown_s if self._costs else 0.0
            totals = [*totals[-(_COSTS_KEPT - 1) :], stall_s + previous]
        return statistics.median(totals) if totals else None

    def _decide(self, step: int, stall_s: float) -> None:
        step_s, cost = self.step_s(), self._cost_estimate(stall_s)
        assert cost is not None
        if step_s is None:
            proposal, reason = 1, "no step measured yet: saving again at the next step"
        else:
            choice = choose_interval(cost, step_s, self.max_overhead, self.mtbf_s)
            proposal, reason = choice.every, choice.reason
        every = self.agree(proposal)
        if every != proposal:
            reason += f"; {every} step(s) agreed with the other ranks"
        self._next = step + every
        if every != self._every:
            self._decisions.append(Decision(step, every, reason, cost, step_s, self.mtbf_s))
            log.info("checkpoint interval at step %d: every %d step(s) (%s)", step, every, reason)
        self._every, self._reason = every, reason
