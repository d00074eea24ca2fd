"""The whole demo on a tiny model: reference, SIGKILL, resume on 1 process, then on 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unickpt.cli.demo import render
from unickpt.demo import DemoConfig, run_demo
from unickpt.demo.model import GPTConfig


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_resumes_match_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a relative out_dir, as the default out/demo is
    config = DemoConfig(
        out_dir="out/demo",
        steps=12,
        save_every=2,
        batch_size=8,
        corpus_chars=20_000,
        model=GPTConfig(vocab_size=32, context_len=16, n_layers=1, n_heads=2, d_model=32),
    )
    result = run_demo(config)

    reference, train, shrunk, regrown = result.phases
    assert [p.world_size for p in result.phases] == [2, 2, 1, 2]
    assert sorted(reference.losses) == list(range(1, 13))
    assert train.killed is not None and train.killed.step == config.kill_step == 4
    assert max(train.losses) <= config.kill_step
    assert shrunk.resumed_from in (2, 4)  # the save in flight at the kill may have committed
    assert regrown.resumed_from == config.regrow_step == 8
    assert sorted(regrown.losses) == list(range(9, 13))
    assert all(s.durable_s is not None for s in shrunk.saves.values())

    by_phase = {c.phase: c for c in result.comparisons}
    assert by_phase["train"].expected == "bitwise" and by_phase["train"].bitwise
    assert by_phase["resume-1"].restored_exactly and by_phase["resume-2"].restored_exactly
    assert by_phase["resume-1"].max_abs_diff <= config.loss_tolerance  # other world size
    # Back at the reference's world size: bit for bit whenever the 1-process run kept the
    # reference's state bit for bit (it does with one thread per process), else within tolerance.
    assert by_phase["resume-2"].matches
    if by_phase["resume-2"].started_as_reference:
        assert by_phase["resume-2"].bitwise
    assert result.all_match

    summary = json.loads(Path(result.summary_path).read_text())
    assert summary["all_match"] is True and len(summary["comparisons"]) == 3
    assert Path(result.chart_path or "").read_bytes()[:4] == b"\x89PNG"
    report = render(result)
    assert "every resumed run matches the reference" in report
    assert "SIGKILLed" in report
    assert f"checkpoints: {tmp_path / 'out' / 'demo' / 'checkpoints'}" in report
