"""A save's timeline: where its time went on this rank, phase by phase."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unickpt
import unickpt.storage.local as local_storage
from unickpt.engine.timeline import PHASES, Timeline


def test_a_save_reports_every_phase_it_passed(tmp_path: Path) -> None:
    state = {"w": torch.randn(3_000_000), "b": torch.randn(10)}
    report = unickpt.save(tmp_path / "plain", state)
    assert list(report.timeline) == [
        "plan",
        "hash",
        "write",
        "file",
        "complete",
        "gather",
        "commit",
    ]
    assert all(v >= 0.0 for v in report.timeline.values())
    assert report.timeline["file"] <= report.write_s
    packed = unickpt.save(tmp_path / "packed", state, compress=True)
    assert list(packed.timeline)[:2] == ["plan", "compress"]
    staged = unickpt.async_save(tmp_path / "staged", state, staging_bytes=4 << 20).wait()
    assert {"hash", "write", "file", "complete"} <= staged.timeline.keys()


def test_phases_add_up_across_threads_in_their_order() -> None:
    tl = Timeline()
    tl.add("write", 1.0)
    tl.add("plan", 0.5)
    tl.add("write", 2.0)
    with tl.timed("commit"):
        pass
    seconds = tl.seconds()
    assert list(seconds) == ["plan", "write", "commit"]
    assert seconds["write"] == 3.0 and seconds["plan"] == 0.5
    assert list(PHASES).index("hash") < list(PHASES).index("complete")


@pytest.mark.parametrize("early", [False, True])
def test_a_save_with_or_without_early_writeback_loads_bitwise(
    tmp_path: Path, early: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_storage, "EARLY_WRITEBACK", early)
    state = {"w": torch.randn(5_000_000), "i": torch.arange(1000)}
    unickpt.save(tmp_path / "ckpt", state)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    unickpt.load(tmp_path / "ckpt", out)
    assert all(torch.equal(out[k], state[k]) for k in state)
