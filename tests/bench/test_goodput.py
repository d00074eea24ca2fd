"""The goodput script's accounting of lost work (benchmarks/goodput.py)."""

from __future__ import annotations

from types import ModuleType

from tests.bench.scripts import load_script


def _goodput() -> ModuleType:
    return load_script("goodput")


def _start(step: int | None, *sources: str) -> dict:
    return {"start": step, "restore_s": 0.5, "sources": list(sources), "at": 0.0}


def test_lost_work_counts_from_the_newest_step_any_job_finished() -> None:
    lines = [
        _start(None, "none", "none"),
        *({"step": s} for s in range(8)),  # the first job trains steps 0-7, saved up to 6
        _start(6, "memory", "peer"),  # lost: step 7
        _start(6, "memory", "memory"),  # killed before training a step: lost step 7 again
        {"step": 7},
        {"step": 8},
        _start(None, "none", "none"),  # nothing survived: steps 0-8 lost
    ]
    lost, restores = _goodput().lost_work(lines)
    assert lost == [1, 1, 9]
    assert restores == [(0.5, "memory+peer"), (0.5, "memory"), (0.5, "none")]
