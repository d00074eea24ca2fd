"""The per-tensor load benchmark runs every system and checks what each loaded."""

from __future__ import annotations

from tests.bench.scripts import load_script


def test_every_system_loads_the_saved_values() -> None:
    script = load_script("load_planning")
    result = script.measure(tensors=13, runs=1)  # each load is checked bitwise inside
    assert sorted(result) == ["dcp", "torch.load", "unickpt"]
    assert all(r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in result.values())
    state = script._state(13, fill=False)
    assert len(state) == 13 and all(not v.any() for v in state.values())
