"""The Checkpointer's interval on a real training loop: maybe_save, every='auto' and every=N,
starts recorded at the root. No timing asserts: the decisions must be consistent with the
saves made."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

import unickpt
from tests.distributed import run_ranks
from unickpt.tuning import Tuning


def _train(ckpt: unickpt.Checkpointer, steps: range) -> list[int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": opt}
    saved = []
    for step in steps:
        x = torch.randn(64, 32)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ckpt.maybe_save(step, state) is not None:
            saved.append(step)
    ckpt.wait()
    return saved


def _interval_at(tuning: Tuning, step: int) -> int:
    return [d.every for d in tuning.decisions if d.step <= step][-1]


@pytest.mark.parametrize("async_save", [True, False])
def test_auto_interval_on_a_real_loop(tmp_path: Path, async_save: bool) -> None:
    with unickpt.Checkpointer(
        tmp_path, every="auto", max_overhead=0.5, mode="async" if async_save else "sync"
    ) as ckpt:
        saved = _train(ckpt, range(10, 60))
        tuning = ckpt.tuning
        assert ckpt.steps() == saved
    assert tuning is not None and tuning.mode == "auto"
    assert saved[0] == 13  # after three measured steps
    assert tuning.saves == len(saved)  # how many depends on the machine's speed
    for earlier, later in itertools.pairwise(saved):
        assert later - earlier == _interval_at(tuning, earlier)
    assert tuning.step_s is not None and tuning.step_s > 0
    assert tuning.save_cost_s is not None and tuning.save_cost_s > 0
    assert tuning.decisions[0].step == 13 and tuning.every == tuning.decisions[-1].every
    assert tuning.next_save_step == saved[-1] + tuning.every
    assert tuning.overhead is not None and tuning.mtbf_s is None


def test_fixed_interval_and_learnt_mtbf(tmp_path: Path) -> None:
    with unickpt.Checkpointer(tmp_path, every=4) as ckpt:
        assert _train(ckpt, range(1, 13)) == [4, 8, 12]
        assert ckpt.tuning is not None and ckpt.tuning.mtbf_source is None
    # A second job on the root is a restart: an MTBF is learnt from the recorded starts.
    with unickpt.Checkpointer(tmp_path, every="auto") as ckpt:
        _train(ckpt, range(13, 20))
        tuning = ckpt.tuning
    assert tuning is not None and tuning.mtbf_source == "learnt from restarts"
    assert tuning.mtbf_s is not None and tuning.mtbf_s > 0
    starts = json.loads((tmp_path / "starts.json").read_text())["starts_unix_s"]
    assert len(starts) == 2
    with unickpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps()[:4] == [4, 8, 12, 16]  # the second job's probe save at 13 + 3
        assert ckpt.tuning is None
        with pytest.raises(unickpt.CheckpointError, match="maybe_save needs an interval"):
            ckpt.maybe_save(1, {})


def _loop_on_ranks(rank: int, world: int, root: str) -> tuple[list[int], int | None]:
    with unickpt.Checkpointer(root, every="auto", max_overhead=0.5) as ckpt:
        saved = _train(ckpt, range(40))
        tuning = ckpt.tuning
    assert tuning is not None
    return saved, tuning.every


def test_ranks_agree_on_the_steps_to_save(tmp_path: Path) -> None:
    first, second = run_ranks(2, _loop_on_ranks, str(tmp_path))
    assert first == second and first[0][0] == 3
