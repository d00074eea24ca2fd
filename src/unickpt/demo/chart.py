"""The demo's chart: loss curves with the saves, the crash and the resumes marked.

The top panel draws every phase over the reference run; the bottom panel draws how far each
phase's loss is from the reference at the same step (zero means bit for bit).
matplotlib is an optional dependency (``pip install 'unickpt[demo]'``); without it no chart
is drawn.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from unickpt.demo.config import DemoConfig, processes_label
from unickpt.demo.record import Comparison, PhaseRecord

logger = logging.getLogger(__name__)

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown")
_LINEAR_BELOW = 1e-8  # the symlog scale is linear below this, so exact zeros can be drawn


def write_chart(
    config: DemoConfig, phases: list[PhaseRecord], comparisons: list[Comparison], path: str
) -> str | None:
    """Draws the chart into ``path`` (PNG); returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed, so no chart; pip install 'unickpt[demo]'")
        return None
    reference, runs = phases[0], phases[1:]
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": (3, 1.4)}
    )
    _draw_reference(top, reference)
    for record, color in zip(runs, _COLORS):
        _draw_phase(top, record, color)
        _draw_difference(bottom, record, reference, color)
    _style(top, bottom, config, reference, comparisons)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _draw_reference(axes: Any, reference: PhaseRecord) -> None:
    steps = sorted(reference.losses)
    axes.plot(
        steps,
        [reference.losses[s] for s in steps],
        color="0.55",
        linewidth=5,
        alpha=0.4,
        label=f"{reference.label}, no checkpoints",
    )


def _draw_phase(axes: Any, record: PhaseRecord, color: str) -> None:
    steps = sorted(record.losses)
    losses = [record.losses[s] for s in steps]
    axes.plot(steps, losses, color=color, linewidth=1.4, label=record.label)
    durable = [s for s, save in record.saves.items() if save.committed]
    lost = [s for s, save in record.saves.items() if not save.committed]
    axes.scatter(
        durable, [record.losses[s] for s in durable], marker="v", s=36, color=color, zorder=3
    )
    axes.scatter(
        lost,
        [record.losses[s] for s in lost],
        marker="v",
        s=36,
        facecolors="none",
        edgecolors=color,
        zorder=3,
    )
    if record.resumed_from is not None:
        axes.axvline(record.resumed_from, color=color, linestyle=":", linewidth=1.2)
        axes.annotate(
            f"resumed from step {record.resumed_from}\non {processes_label(record.world_size)}",
            (record.resumed_from, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, -4),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color=color,
        )
    if record.killed is not None and record.killed.step in record.losses:
        step = record.killed.step
        axes.scatter([step], [record.losses[step]], marker="X", s=140, color="red", zorder=4)
        axes.annotate(
            f"rank {record.killed.rank} SIGKILLed\n(save of step {step} in flight)",
            (step, record.losses[step]),
            xytext=(10, 18),
            textcoords="offset points",
            fontsize=8,
            color="red",
        )


def _draw_difference(axes: Any, record: PhaseRecord, reference: PhaseRecord, color: str) -> None:
    steps = sorted(record.losses)
    diffs = [abs(record.losses[s] - reference.losses[s]) for s in steps]
    axes.plot(steps, diffs, color=color, linewidth=1.2, marker=".", markersize=4)


def _style(
    top: Any,
    bottom: Any,
    config: DemoConfig,
    reference: PhaseRecord,
    comparisons: list[Comparison],
) -> None:
    millions = reference.num_parameters / 1e6
    top.set_title(
        f"GPT, {millions:.2f}M parameters, FSDP2 on {config.world_size} processes: "
        f"killed, resumed on 1, then on {config.world_size}"
    )
    top.set_ylabel("training loss (global batch)")
    top.scatter([], [], marker="v", color="0.3", label="checkpoint saved (hollow: lost)")
    top.legend(loc="lower left", fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_yscale("symlog", linthresh=_LINEAR_BELOW)
    largest = max((c.max_abs_diff for c in comparisons), default=0.0)
    top_decade = math.ceil(math.log10(10 * max(largest, config.loss_tolerance)))
    bottom.set_ylim(-0.3 * _LINEAR_BELOW, 10.0**top_decade)
    bottom.set_yticks([0.0, *(10.0**e for e in range(-8, top_decade + 1, 2))])
    bottom.axhline(config.loss_tolerance, color="red", linestyle="--", linewidth=0.8)
    bottom.annotate(
        "tolerance",
        (0.0, config.loss_tolerance),
        xycoords=("axes fraction", "data"),
        xytext=(4, 2),
        textcoords="offset points",
        fontsize=7,
        color="red",
    )
    bottom.set_ylabel("|loss - reference|")
    bottom.set_title("distance from the reference at each step (0: bit for bit)", fontsize=9)
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
