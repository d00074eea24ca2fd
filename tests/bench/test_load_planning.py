"""The per-tensor load benchmark runs every system and checks what each loaded."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def _script() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "load_planning.py"
    spec = importlib.util.spec_from_file_location("load_planning_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_system_loads_the_saved_values() -> None:
    script = _script()
    result = script.measure(tensors=13, runs=1)  # each load is checked bitwise inside
    assert sorted(result) == ["dcp", "torch.load", "unickpt"]
    assert all(r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in result.values())
    state = script._state(13, fill=False)
    assert len(state) == 13 and all(not v.any() for v in state.values())
