"""torch.distributed.checkpoint.save folders -> unickpt -> unickpt.load, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import unickpt
from unickpt.tools import import_dcp

from .helpers import assert_bitwise, assert_same, make_model, zeros_like


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_checkpoint_roundtrip(tmp_path: Path) -> None:
    model = make_model(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "momentum": {k: optimizer.state[p]["momentum_buffer"] for k, p in model.named_parameters()},
        "extra": {"big": torch.randn(300, 200), "ids": torch.arange(7)},
        "sched": {"milestones": [3, 6], "groups": [{"lr": 0.1, "name": "a"}]},
        "step": 5,
        "tag": "x",
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    report = import_dcp(tmp_path / "dcp", tmp_path / "c", group_bytes=4096)
    assert (report.tensors, report.values) == (10, 4)
    dest = zeros_like(state)
    unickpt.load(tmp_path / "c", dest)
    assert_same(dest, state)
    fresh = make_model(8)
    unickpt.load(tmp_path / "c", {"model": fresh}, strict=False)
    for k, v in model.state_dict().items():
        assert_bitwise(fresh.state_dict()[k], v, k)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_import_progress_covers_reading_then_saving(tmp_path: Path) -> None:
    state = {"a": torch.randn(300, 200), "b": torch.arange(7)}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    calls: list[tuple[int, int]] = []
    import_dcp(tmp_path / "dcp", tmp_path / "c", progress=lambda d, t: calls.append((d, t)))
    done = [d for d, _ in calls]
    assert done == sorted(done) and calls[-1][0] == calls[-1][1]
    assert {t for _, t in calls} == {2 * (300 * 200 * 4 + 7 * 8)}
