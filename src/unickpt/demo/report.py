"""The demo's results as a JSON summary and as plain-text tables."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from unickpt.demo.record import Comparison, DemoResult, PhaseRecord, SaveRecord

SUMMARY_VERSION = 1


def write_summary(result: DemoResult) -> None:
    """Writes ``result`` as JSON to ``result.summary_path``."""
    summary = {
        "version": SUMMARY_VERSION,
        "all_match": result.all_match,
        "elapsed_s": result.elapsed_s,
        "chart": result.chart_path,
        "config": dataclasses.asdict(result.config),
        "kill_step": result.config.kill_step,
        "regrow_step": result.config.regrow_step,
        "phases": [_phase_json(p) for p in result.phases],
        "comparisons": [
            {**dataclasses.asdict(c), "matches": c.matches} for c in result.comparisons
        ],
    }
    tmp = result.summary_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, result.summary_path)


def _phase_json(record: PhaseRecord) -> dict[str, Any]:
    data = dataclasses.asdict(record)
    data["losses"] = [[step, loss] for step, loss in sorted(record.losses.items())]
    data["saves"] = [dataclasses.asdict(s) for _, s in sorted(record.saves.items())]
    return data


def format_phases(phases: list[PhaseRecord]) -> str:
    rows = [("phase", "steps", "resumed from", "load", "time", "event")]
    for p in phases:
        steps = f"{min(p.losses)}-{max(p.losses)}" if p.losses else "-"
        resumed = "-" if p.load_s is None else str(p.resumed_from or "nothing")
        note = ""
        if p.killed is not None:
            note = f"rank {p.killed.rank} SIGKILLed during the save of step {p.killed.step}"
        rows.append((p.label, steps, resumed, _ms(p.load_s), _seconds(p.elapsed_s), note))
    return _table(rows)


def format_saves(phases: list[PhaseRecord]) -> str:
    rows = [("phase", "step", "training stall", "time to durable", "size")]
    for p in phases:
        for save in sorted(p.saves.values(), key=lambda s: s.step):
            durable = _ms(save.durable_s) if save.durable_s is not None else _untimed(save)
            rows.append(
                (
                    p.label,
                    str(save.step),
                    _ms(save.blocking_s),
                    durable,
                    _megabytes(save.size_bytes),
                )
            )
    return _table(rows) + "\n" + _save_totals(phases)


def _save_totals(phases: list[PhaseRecord]) -> str:
    saves = [save for p in phases for save in p.saves.values()]
    if not saves:
        return "no saves"
    stalls = [s.blocking_s for s in saves]
    durables = [s.durable_s for s in saves if s.durable_s is not None]
    count = f"{len(saves)} save{'' if len(saves) == 1 else 's'}"
    text = (
        f"{count}: training stall {_ms(sum(stalls) / len(stalls))} on average "
        f"(at most {_ms(max(stalls))})"
    )
    if durables:
        text += f", durable after {_ms(sum(durables) / len(durables))} on average"
    lost = sum(not s.committed for s in saves)
    return text + (f", {lost} lost in the crash" if lost else "")


def _untimed(save: SaveRecord) -> str:
    return "committed, not timed (crash)" if save.committed else "lost in the crash"


def format_verdicts(comparisons: list[Comparison]) -> str:
    return "\n".join(_verdict(c) for c in comparisons)


def _verdict(c: Comparison) -> str:
    mark = "ok" if c.matches else "MISMATCH"
    lines = [f"[{mark}] {c.label}, steps {c.first_step}-{c.last_step}"]
    if c.resumed and c.resumed_from is None:
        lines.append("no checkpoint was committed before the crash: started from step 0")
    if c.restored_exactly is not None:
        restored = "restored bit for bit" if c.restored_exactly else "DIFFERS from the one saved"
        lines.append(f"loaded state of step {c.resumed_from}: {restored}")
    lines.append(f"losses: {_loss_note(c)}")
    if c.states_as_reference is not None:
        lines.append(f"state at each save: {_state_note(c)}")
    return "\n     ".join(lines)


def _loss_note(c: Comparison) -> str:
    if c.bitwise:
        return "identical to the reference, bit for bit"
    if c.max_abs_diff > c.tolerance:
        return f"DIFFER from the reference by up to {c.max_abs_diff:.3e}"
    note = f"within {c.max_abs_diff:.1e} of the reference (tolerance {c.tolerance:.0e})"
    if c.expected == "bitwise":
        return note + ", but bit for bit was expected"
    return note + ", as sums run in another order"


def _state_note(c: Comparison) -> str:
    if c.states_as_reference:
        return "identical to the reference's, bit for bit"
    if c.expected == "bitwise":
        return "DIFFERS from the reference's"
    return "differs from the reference's in the last bits (another world size)"


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _seconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def _megabytes(size: int | None) -> str:
    return "-" if size is None else f"{size / 1e6:.2f} MB"
