"""How often to save, from what a save costs and how long a step takes (pure functions).

Two rules, as in CheckFreq and Young/Daly:

- the overhead bound: a save every ``n`` steps costs ``save_cost_s / (n * step_s)`` of the
  loop's time; the smallest ``n`` keeping that at most ``max_overhead`` is the most frequent
  saving the bound allows;
- with a mean time between failures ``mtbf_s``, the interval minimising the expected time lost
  (saving plus recomputing after a failure) is about ``sqrt(2 * save_cost_s * mtbf_s)`` seconds
  (Young's approximation); it is never taken below the overhead bound's interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    """An interval in steps and why."""

    every: int
    reason: str


def bound_interval(save_cost_s: float, step_s: float, max_overhead: float) -> int:
    """The smallest interval (steps) whose overhead ``cost / (n * step)`` is <= the bound."""
    if save_cost_s <= 0.0:
        return 1
    if step_s <= 0.0:
        step_s = 1e-9
    n = save_cost_s / (max_overhead * step_s)
    return max(1, math.ceil(n - 1e-9))


def young_daly_s(save_cost_s: float, mtbf_s: float) -> float:
    """The interval in seconds minimising expected lost time: ``sqrt(2 * C * MTBF)``."""
    return math.sqrt(2.0 * max(save_cost_s, 0.0) * mtbf_s)


def overhead(save_cost_s: float, step_s: float, every: int) -> float:
    """The fraction of the loop's time that saving every ``every`` steps costs."""
    if step_s <= 0.0:
        return 0.0 if save_cost_s <= 0.0 else math.inf
    return max(save_cost_s, 0.0) / (every * step_s)


def choose_interval(
    save_cost_s: float, step_s: float, max_overhead: float, mtbf_s: float | None
) -> Choice:
    """The interval for these costs: Young/Daly when ``mtbf_s`` is known, never more often
    than the overhead bound allows; otherwise as often as the bound allows."""
    bound = bound_interval(save_cost_s, step_s, max_overhead)
    costs = f"a save costs {save_cost_s:.4g} s, a step {step_s:.4g} s"
    if mtbf_s is None:
        return Choice(
            bound,
            f"{costs}: every {bound} step(s) keeps the overhead "
            f"({overhead(save_cost_s, step_s, bound):.2%}) within {max_overhead:.2%}",
        )
    ideal_s = young_daly_s(save_cost_s, mtbf_s)
    ideal = max(1, round(ideal_s / step_s)) if step_s > 0.0 else 1
    young = f"{costs}, MTBF {mtbf_s:.4g} s: Young/Daly sqrt(2*C*MTBF) = {ideal_s:.4g} s"
    if ideal >= bound:
        return Choice(ideal, f"{young} = {ideal} step(s)")
    return Choice(
        bound,
        f"{young} = {ideal} step(s), raised to {bound} to keep the overhead within "
        f"{max_overhead:.2%}",
    )
