"""The cyclic garbage collector is paused for a load and restored after it, as it was."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from unickpt.errors import CheckpointMismatchError


class _Probe:
    """A stateful object that records whether the collector ran while the load placed it; it
    can wait at a barrier there, so that two loads overlap."""

    def __init__(self, barrier: threading.Barrier | None = None) -> None:
        self.barrier = barrier
        self.enabled: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        return {"w": torch.arange(4.0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.enabled.append(gc.isenabled())
        if self.barrier is not None:
            self.barrier.wait(timeout=60)
            self.enabled.append(gc.isenabled())


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    unickpt.save(path, {"probe": _Probe(), "t": torch.ones(3)})
    return path


def test_a_load_pauses_the_collector_and_restores_it(saved: Path) -> None:
    assert gc.isenabled()
    probe = _Probe()
    unickpt.load(saved, {"probe": probe, "t": torch.zeros(3)})
    assert probe.enabled == [False]
    assert gc.isenabled()

    gc.disable()  # a caller that turned it off keeps it off
    try:
        probe = _Probe()
        unickpt.load(saved, {"probe": probe, "t": torch.zeros(3)})
        assert probe.enabled == [False]
        assert not gc.isenabled()
    finally:
        gc.enable()

    with pytest.raises(CheckpointMismatchError, match="'u'"):  # a failed load restores it too
        unickpt.load(saved, {"probe": _Probe(), "t": torch.zeros(3), "u": torch.zeros(1)})
    assert gc.isenabled()


def test_two_loads_at_once_restore_it_when_the_last_ends(saved: Path) -> None:
    barrier = threading.Barrier(2)
    probes = [_Probe(barrier), _Probe(barrier)]
    errors: list[BaseException] = []

    def one(probe: _Probe) -> None:
        try:
            unickpt.load(saved, {"probe": probe, "t": torch.zeros(3)})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in probes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.enabled for p in probes] == [[False, False], [False, False]]
    assert gc.isenabled()
