"""Choosing when to checkpoint: the interval tuner, its formulas, restarts seen at a root."""

from .interval import Choice, bound_interval, choose_interval, young_daly_s
from .tuner import Decision, IntervalTuner, SaveCost, Tuning

__all__ = [
    "Choice",
    "Decision",
    "IntervalTuner",
    "SaveCost",
    "Tuning",
    "bound_interval",
    "choose_interval",
    "young_daly_s",
]
