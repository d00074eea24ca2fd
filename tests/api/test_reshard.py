"""Any save layout and world size into any load layout and world size, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unickpt
from tests.api.fresh_leaves import filled_like
from tests.api.layouts_zoo import LAYOUTS, global_tensors, local_of
from tests.distributed import run_ranks

WORLDS = (1, 2, 3, 4)


def _save(rank: int, world: int, path: str) -> None:
    tensors = global_tensors()
    state = {lay: {n: f(t, rank, world) for n, t in tensors.items()} for lay, f in LAYOUTS.items()}
    unickpt.save(path, state)
    replicated = {f"t{i}": torch.full((100 + 37 * i,), float(i)) for i in range(20)}
    unickpt.save(path + "-replicated", replicated)


def _load_all(rank: int, world: int, root: str) -> list[str]:
    tensors = global_tensors()
    # each destination layout of each tensor, made once (a DTensor is made by a collective):
    # the values every load must give; each load goes into fresh leaves of these layouts
    wanted = {
        dest: {n: make(t, rank, world) for n, t in tensors.items()}
        for dest, make in LAYOUTS.items()
    }
    failures = []
    for saved_world in WORLDS:
        path = f"{root}/w{saved_world}"
        for dest_name, made in wanted.items():
            state = {lay: {n: filled_like(leaf, -7) for n, leaf in made.items()} for lay in LAYOUTS}
            unickpt.load(path, state)
            for lay in LAYOUTS:
                for n, leaf in made.items():
                    got = local_of(state[lay][n])
                    want = local_of(leaf)
                    if got.dtype != want.dtype or not torch.equal(got, want):
                        failures.append(f"{lay}@{saved_world} -> {dest_name}@{world}: {n}")
    return failures


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reshard")
    for world in WORLDS:
        run_ranks(world, _save, str(root / f"w{world}"))
    return root


@pytest.mark.parametrize("load_world", WORLDS)
def test_every_layout_into_every_layout(saved: Path, load_world: int) -> None:
    results = run_ranks(load_world, _load_all, str(saved))
    failures = sorted({f for r in results for f in r})
    assert failures == [], f"{len(failures)} mismatches, e.g. {failures[:10]}"


def test_replicas_written_once_and_balanced(saved: Path) -> None:
    from unickpt.engine.commit import read_checkpoint
    from unickpt.storage import LocalStorage

    _, meta = read_checkpoint(LocalStorage(saved / "w4"))
    tensors = global_tensors()
    for key, t in meta.tensors.items():
        total = sum(c.nbytes for c in t.chunks)
        name = key.split(".")[-1]
        assert total == tensors[name].numel() * tensors[name].element_size(), key

    _, meta = read_checkpoint(LocalStorage(saved / "w4-replicated"))
    sizes: dict[int, int] = {}
    for t in meta.tensors.values():
        assert len(t.chunks) == 1
        sizes[t.chunks[0].file] = sizes.get(t.chunks[0].file, 0) + t.chunks[0].nbytes
    largest = max(c.nbytes for t in meta.tensors.values() for c in t.chunks)
    assert len(sizes) == 4
    assert max(sizes.values()) - min(sizes.values()) <= largest, sizes
