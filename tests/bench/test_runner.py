"""unickpt's own rows (and torch.save's) through the runner, on 2 real ranks: every element of
every loaded state is checked by the digest, in the saved layout and in the other one, and a
load that puts a block in the wrong place (same values, same sums) fails its row. DCP's row is
measured through the whole harness (test_bench.py)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_ranks, shared_dir
from unickpt.bench.model import TrainState
from unickpt.bench.systems.unickpt_systems import UnickptSystem

_SYSTEMS = ("unickpt", "unickpt-async", "unickpt-zero-stall", "torch-save")


class MisplacingSystem(UnickptSystem):
    """unickpt's load, then the first two rows of one local shard swapped: every value is
    still there (a check of sums or counts would pass), but a block sits in the wrong place."""

    def load(self, path: Path, state: TrainState) -> None:
        super().load(path, state)
        _swap_rows(state)

    def reshard_load(self, path: Path, state: TrainState) -> None:
        super().load(path, state)
        _swap_rows(state)


def _swap_rows(state: TrainState) -> None:
    param = state.model.blocks[0].fc.weight
    local = param.to_local()  # type: ignore[operator]
    with torch.no_grad():
        local[[0, 1]] = local[[1, 0]]


def _copy_parameters(source: TrainState, target: TrainState) -> None:
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for src, dst in zip(source.model.parameters(), target.model.parameters()):
            whole = src.full_tensor()  # type: ignore[operator]
            piece = distribute_tensor(whole, dst.device_mesh, dst.placements)  # type: ignore[attr-defined]
            dst.to_local().copy_(piece.to_local())  # type: ignore[operator]


def _measure_all(rank: int, world: int, workdir: str) -> dict[str, Any]:
    from unickpt.bench.model import build_train_state, config_for_params
    from unickpt.bench.runner import measure_baseline, measure_system
    from unickpt.bench.systems import create_system
    from unickpt.bench.systems.registry import SYSTEMS_BY_NAME
    from unickpt.bench.verify import mismatches, state_digest

    torch.set_num_threads(1)
    config = config_for_params(200_000)
    state = build_train_state(config, "shard0", 8)
    other = build_train_state(config, "shard1", 8)
    # The objects of the imports and of the states stay: the collection the runner makes
    # before each timed step (for clean timings, not asserted here) then skips them.
    gc.freeze()
    base = measure_baseline(state, repeats=1)
    out: dict[str, Any] = {}

    # The digest depends on the values alone: the same values in the other layout match.
    _copy_parameters(state, other)
    digest = state_digest(state)
    other_digest = state_digest(other)
    names = [name for name, _ in state.model.named_parameters()]
    out["layouts_agree"] = all(other_digest[n] == digest[n] for n in names)
    out["layouts_differ"] = other_digest != digest  # the optimizer states were not copied
    weight = state.model.blocks[0].fc.weight
    before = weight.to_local().flatten().sort().values  # type: ignore[operator]
    _swap_rows(state)
    after = weight.to_local().flatten().sort().values  # type: ignore[operator]
    out["swap_keeps_values"] = torch.equal(before, after)
    out["swap_caught"] = mismatches(digest, state_digest(state))
    _swap_rows(state)

    for name in _SYSTEMS:
        system = create_system(name)
        try:
            m = measure_system(system, Path(workdir), state, other, base, warmup=True)
        finally:
            system.close()
        out[name] = (m.mismatches, m.errors, m.values)
    system = MisplacingSystem(SYSTEMS_BY_NAME["unickpt"])
    m = measure_system(system, Path(workdir), state, other, base, warmup=False)
    out["misplaced"] = m.mismatches
    return out


@pytest.mark.timeout(300)
def test_unickpt_rows_verified_and_misplaced_block_caught(tmp_path: Path) -> None:
    results = run_ranks(2, _measure_all, shared_dir(tmp_path, "ckpt"), timeout_s=280)
    for out in results:
        assert out["layouts_agree"] and out["layouts_differ"]
        assert out["swap_keeps_values"]
        assert out["swap_caught"] == ["blocks.0.fc.weight"]
        for name in _SYSTEMS:
            found, errors, values = out[name]
            assert found == {"load": 0, "reshard load": 0}, (name, errors)
            assert errors == ()
            for key in ("blocking_s", "stall_s", "durable_s", "load_s", "reshard_load_s"):
                assert key in values, (name, key)
        assert out["misplaced"] == {"load": 1, "reshard load": 1}
    for name in _SYSTEMS:  # as the report sums them over ranks
        assert sum(out[name][2]["bytes_written"] for out in results) > 0, name
