"""Random states (shapes, empty tensors, dtypes, layouts, engine sizes) saved on 2 and 3 ranks
load bit for bit on 1 to 4 ranks under other random layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

import unickpt
from tests.api.fresh_leaves import filled_like
from tests.api.random_states import configs, differences, state
from tests.distributed import run_ranks

SEEDS = range(24)
SAVE_WORLDS = (2, 3)


def _save(rank: int, world: int, root: str) -> None:
    for seed in SEEDS:
        leaves, _ = state(seed, rank, world, loading=False)
        unickpt.save(f"{root}/case-{seed}", leaves, config=configs(seed)[0])


def _load(rank: int, world: int, root: str) -> list[str]:
    failures = []
    for seed in SEEDS:
        want, told = state(seed, rank, world, loading=True)
        for saved_world in SAVE_WORLDS:
            got = {k: filled_like(leaf, 0) for k, leaf in want.items()}  # a missed element shows
            unickpt.load(f"{root}/w{saved_world}/case-{seed}", got, config=configs(seed)[1])
            failures += [
                f"case {seed} saved on {saved_world}, {k} {told[k]}" for k in differences(want, got)
            ]
    return failures


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("random")
    for world in SAVE_WORLDS:
        run_ranks(world, _save, str(root / f"w{world}"))
    return root


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_random_states_load_exactly_on_other_worlds(saved: Path, world: int) -> None:
    failures = sorted({f for r in run_ranks(world, _load, str(saved)) for f in r})
    assert failures == [], f"{len(failures)} tensors differ, e.g. {failures[:5]}"
