"""The interval tuner on a fake clock with made-up costs: chosen intervals, re-tuning, Young/Daly,
the overhead bound, fixed intervals."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from unickpt.errors import CheckpointError
from unickpt.tuning import IntervalTuner, SaveCost, bound_interval, choose_interval, young_daly_s
from unickpt.tuning.restarts import Start, mtbf_from_starts


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def drive(
    tuner: IntervalTuner,
    clock: FakeClock,
    steps: range,
    step_s: float,
    stall_s: Callable[[int], float],
    background_steps: int = 0,
    slowdown_s: float = 0.0,
) -> list[int]:
    """A loop: each step takes ``step_s`` (plus ``slowdown_s`` while a save's background work
    runs, for ``background_steps`` steps after it); a save stalls the call by ``stall_s``."""
    saved: list[int] = []
    now = [steps.start]

    def finished(save_step: int) -> bool:
        return now[0] > save_step + background_steps

    for step in steps:
        in_flight = bool(saved) and step <= saved[-1] + background_steps
        clock.t += step_s + (slowdown_s if in_flight else 0.0)
        if tuner.begin(step):
            clock.t += stall_s(step)
            saved.append(step)
            tuner.end(step, True, functools.partial(finished, step))
        else:
            tuner.end(step, False)
        now[0] = step + 1
    return saved


def test_the_interval_keeps_the_overhead_within_the_bound() -> None:
    clock = FakeClock()
    tuner = IntervalTuner("auto", max_overhead=0.01, clock=clock)
    saved = drive(tuner, clock, range(3000), 0.125, lambda s: 0.5)
    # 3 warm-up steps, a probe save at step 3, then every 0.5 / (0.01 * 0.125) = 400 steps.
    assert saved == [3, 403, 803, 1203, 1603, 2003, 2403, 2803]
    t = tuner.tuning
    assert (t.mode, t.every, t.step_s, t.save_cost_s, t.saves) == ("auto", 400, 0.125, 0.5, 8)
    assert t.overhead == pytest.approx(0.01)
    assert [(d.step, d.every) for d in t.decisions] == [(3, 400)]
    assert "every 400 step(s) keeps the overhead (1.00%) within 1.00%" in t.reason
    assert [(c.step, c.total_s) for c in t.costs] == [(2003, 0.5), (2403, 0.5), (2803, 0.5)]


def test_background_slowdown_counts_as_cost() -> None:
    clock = FakeClock()
    tuner = IntervalTuner("auto", max_overhead=0.01, clock=clock)
    # 0.0625 s of stall, then 4 steps slowed by 0.0625 s each: 0.3125 s per save.
    saved = drive(tuner, clock, range(2000), 0.125, lambda s: 0.0625, 4, 0.0625)
    t = tuner.tuning
    assert t.costs[-1].stall_s == 0.0625 and t.costs[-1].slowdown_s == 0.25
    assert t.save_cost_s == 0.3125 and t.step_s == 0.125
    assert t.every == 250  # 0.3125 / (0.01 * 0.125)
    assert saved[-2:] == [saved[-3] + 250, saved[-3] + 500]


def test_cheaper_saves_shorten_the_interval_within_two_saves() -> None:
    clock = FakeClock()
    tuner = IntervalTuner("auto", max_overhead=0.01, clock=clock)
    saved = drive(tuner, clock, range(1000), 0.125, lambda s: 0.5 if s < 800 else 0.0009765625)
    assert saved[:3] == [3, 403, 803]
    # The save at 803 is cheap, but the median of the last three is not yet; from 1203 on the
    # interval is ceil(2**-10 / (0.01 * 0.125)) = 1.
    saved = drive(tuner, clock, range(1000, 1300), 0.125, lambda s: 0.0009765625)
    assert saved[:3] == [1203, 1204, 1205] and saved[-1] == 1299
    decisions = [(d.step, d.every) for d in tuner.tuning.decisions]
    assert decisions == [(3, 400), (1203, 1)]


def test_young_daly_with_a_given_mtbf() -> None:
    clock = FakeClock()
    tuner = IntervalTuner("auto", max_overhead=0.01, mtbf_s=40_000.0, clock=clock)
    saved = drive(tuner, clock, range(1300), 1.0, lambda s: 2.0)
    # sqrt(2 * 2 s * 40000 s) = 400 s = 400 steps; the bound alone would allow 200.
    assert saved == [3, 403, 803, 1203]
    t = tuner.tuning
    assert (t.every, t.mtbf_s, t.mtbf_source) == (400, 40_000.0, "given")
    assert "Young/Daly sqrt(2*C*MTBF) = 400 s = 400 step(s)" in t.reason


def test_young_daly_never_saves_more_often_than_the_bound() -> None:
    clock = FakeClock()
    tuner = IntervalTuner("auto", max_overhead=0.01, mtbf_s=100.0, clock=clock)
    drive(tuner, clock, range(500), 1.0, lambda s: 2.0)
    t = tuner.tuning
    assert t.every == 200 and t.overhead is not None and t.overhead <= 0.01
    assert "= 20 step(s), raised to 200 to keep the overhead within 1.00%" in t.reason


@pytest.mark.parametrize("cost", [0.0, 0.001, 0.3, 7.0, 1234.5])
@pytest.mark.parametrize("mtbf", [None, 1.0, 3600.0, 1e7])
def test_the_bound_holds_for_any_costs(cost: float, mtbf: float | None) -> None:
    choice = choose_interval(cost, 0.2, 0.035, mtbf)
    assert cost / (choice.every * 0.2) <= 0.035 + 1e-12
    assert choice.every >= bound_interval(cost, 0.2, 0.035) >= 1


def test_formulas() -> None:
    assert young_daly_s(2.0, 40_000.0) == 400.0
    assert bound_interval(0.5, 0.125, 0.01) == 400
    assert bound_interval(0.0, 0.125, 0.01) == 1
    assert mtbf_from_starts([Start(100.0)], 500.0) is None
    # Each job ran until the next start (its last save then), the current one for 200 s.
    starts = [Start(100.0, 200.0), Start(200.0, 300.0), Start(300.0)]
    assert mtbf_from_starts(starts, 500.0) == 200.0


def test_a_save_in_flight_when_the_loop_ends_has_a_cost() -> None:
    """The only save's background work outlasts the loop: its cost is its stall while in
    flight, and its stall plus the slowdown measured once its work is done."""
    clock = FakeClock()
    tuner = IntervalTuner("auto", max_overhead=0.01, clock=clock)
    background = [False]
    saved = []
    for step in range(8):
        clock.t += 0.125 + (0.25 if saved else 0.0)
        if tuner.begin(step):
            clock.t += 0.5
            saved.append(step)
            tuner.end(step, True, lambda: background[0])
        else:
            tuner.end(step, False)
    assert saved == [3]
    in_flight = tuner.tuning
    assert in_flight.save_cost_s == 0.5 and in_flight.costs == ()
    background[0] = True  # as after Checkpointer.wait()
    done = tuner.tuning
    assert done.costs == (SaveCost(3, 0.5, 4 * 0.25),)
    assert done.save_cost_s == 0.5 + 4 * 0.25


def test_a_fixed_interval_saves_at_multiples_and_still_measures() -> None:
    clock = FakeClock()
    tuner = IntervalTuner(50, clock=clock)
    saved = drive(tuner, clock, range(1, 201), 0.125, lambda s: 0.25)
    assert saved == [50, 100, 150, 200]
    t = tuner.tuning
    assert (t.mode, t.every, t.save_cost_s, t.reason) == ("fixed", 50, 0.25, "fixed interval")
    assert t.overhead == 0.04


def test_a_learnt_mtbf_does_not_replace_a_given_one() -> None:
    tuner = IntervalTuner("auto", mtbf_s=10.0)
    tuner.learn_mtbf(99.0)
    assert (tuner.mtbf_s, tuner.mtbf_source) == (10.0, "given")
    tuner = IntervalTuner("auto")
    tuner.learn_mtbf(99.0)
    assert (tuner.mtbf_s, tuner.mtbf_source) == (99.0, "learnt from restarts")


def test_bad_arguments() -> None:
    with pytest.raises(CheckpointError, match="every is 0; expected 'auto' or a positive"):
        IntervalTuner(0)
    with pytest.raises(CheckpointError, match="every is 'sometimes'"):
        IntervalTuner("sometimes")
    with pytest.raises(CheckpointError, match="max_overhead is 2; expected a fraction"):
        IntervalTuner("auto", max_overhead=2)
    with pytest.raises(CheckpointError, match="mtbf_s is -1; expected None or a positive"):
        IntervalTuner("auto", mtbf_s=-1)
