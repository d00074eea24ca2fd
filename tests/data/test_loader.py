"""torchdata StatefulDataLoaders saved on 2 ranks, resumed on 1, 2 and 3 ranks.

Real gloo ranks read three loaders wrapped by :func:`unickpt.data.reshardable` (a map-style
dataset through a ``DistributedSampler`` and through a ``ReshardableSampler``, and a
:class:`ShardedStream` of token files), save them with ``unickpt.save`` after 3 batches and go
on to the end of the epoch. Runs on 1, 2 and 3 ranks load that checkpoint and read the rest of
the epoch, then the next one. The 3-rank run saves again inside the rest of the epoch, which it
and the 2-rank run load in turn. Over each whole run
every sample is read exactly once; at the saved world size the batches go on as the
uninterrupted run's, bitwise.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import unickpt
from tests.distributed import run_ranks
from unickpt.data import ReshardableLoader, ReshardableSampler, ShardedStream, reshardable

SAMPLES = 60  # 3 steps of 2 on 2 ranks leave 48: a whole number of batches of 2 on 1, 2, 3
BATCH = 2
STEPS = 3
STEPS_IN_REST = 2  # the 3-rank run's second save: 2 batches into the rest (36 consumed)
TOKENS_PER_SAMPLE = 4
FILE_TOKENS = [37, 50, 23, 61, 44, 29, 55, 40]
MAP_CASES = ("distributed", "reshardable")


class Squares(torch.utils.data.Dataset[torch.Tensor]):
    """Sample ``i`` is ``[i, i * i]``: its id and a value to compare bitwise."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i], dtype=torch.int64)


def _write_sources(folder: Path) -> list[str]:
    paths, start = [], 0
    for i, n in enumerate(FILE_TOKENS):
        path = folder / f"shard-{i:02d}.bin"
        np.arange(start, start + n, dtype=np.uint16).tofile(path)
        paths.append(str(path))
        start += n
    return paths


def _loaders(rank: int, world: int, sources: list[str]) -> dict[str, ReshardableLoader]:
    data = Squares()
    samplers: dict[str, Any] = {
        "distributed": DistributedSampler(data, world, rank, seed=5),
        "reshardable": ReshardableSampler(SAMPLES, seed=7, rank=rank, world_size=world),
    }
    out = {
        name: reshardable(StatefulDataLoader(data, sampler=sampler, batch_size=BATCH))
        for name, sampler in samplers.items()
    }
    stream = ShardedStream(
        sources, rank=rank, world_size=world, tokens_per_sample=TOKENS_PER_SAMPLE
    )
    out["stream"] = reshardable(StatefulDataLoader(stream, batch_size=BATCH))
    return out


def _set_epoch(loaders: dict[str, ReshardableLoader], epoch: int) -> None:
    for name in MAP_CASES:
        loaders[name].loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]


def _ids(batches: list[torch.Tensor], name: str) -> list[int]:
    if name == "stream":
        return [t for b in batches for t in b.flatten().tolist()]
    return [i for b in batches for i in b[:, 0].tolist()]


def _drain(iterators: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    return {name: list(it) for name, it in iterators.items()}


def _take(iterators: dict[str, Any], steps: int) -> dict[str, list[torch.Tensor]]:
    return {name: [next(it) for _ in range(steps)] for name, it in iterators.items()}


def _next_epoch(loaders: dict[str, ReshardableLoader]) -> dict[str, list[int]]:
    _set_epoch(loaders, 1)
    return {name: _ids(list(loaders[name]), name) for name in MAP_CASES}


def _carried(loaders: dict[str, ReshardableLoader]) -> list[int]:
    stream = loaders["stream"].loader.dataset
    assert isinstance(stream, ShardedStream)
    return stream.carried.tolist()


def _train_and_save(rank: int, world: int, sources: list[str], path: str) -> dict[str, Any]:
    loaders = _loaders(rank, world, sources)
    _set_epoch(loaders, 0)
    iterators = {name: iter(d) for name, d in loaders.items()}
    before = _take(iterators, STEPS)
    unickpt.save(path, loaders)
    after = _drain(iterators)
    return {"before": before, "after": after, "carried": _carried(loaders)}


def _resume(
    rank: int, world: int, sources: list[str], path: str, second: str, save_second: bool
) -> dict[str, Any]:
    """Load ``path``, read the rest of the epoch and the next one. With ``save_second``, save
    ``second`` 2 batches into the rest and load it again after; else load ``second`` after."""
    loaders = _loaders(rank, world, sources)
    unickpt.load(path, loaders)
    _set_epoch(loaders, 0)  # the loop resumes in the saved epoch
    iterators = {name: iter(d) for name, d in loaders.items()}
    out: dict[str, Any] = {"first": {}}
    if save_second:
        out["first"] = _take(iterators, STEPS_IN_REST)
        unickpt.save(second, loaders)
    out["rest"] = _drain(iterators)
    out["carried"] = _carried(loaders)
    out["next"] = _next_epoch(loaders)
    again = _loaders(rank, world, sources)
    unickpt.load(second, again)
    _set_epoch(again, 0)
    out["second"] = {"rest": _drain({name: iter(d) for name, d in again.items()})}
    out["second"]["carried"] = _carried(again)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Spawned runs of 2, 3 and 2 ranks; the 1-rank run in this process (no group)."""
    folder = tmp_path_factory.mktemp("loaders")
    sources = _write_sources(folder)
    path, second = str(folder / "at-2"), str(folder / "at-3")
    out = {"saved": run_ranks(2, _train_and_save, sources, path)}
    out["3"] = run_ranks(3, _resume, sources, path, second, True)
    out["2"] = run_ranks(2, _resume, sources, path, second, False)
    out["3->3"] = [r["second"] for r in out["3"]]
    out["3->2"] = [r["second"] for r in out["2"]]
    loaders = _loaders(0, 1, sources)
    unickpt.load(path, loaders)
    _set_epoch(loaders, 0)
    rest = _drain({name: iter(d) for name, d in loaders.items()})
    out["1"] = [{"first": {}, "rest": rest, "carried": _carried(loaders)}]
    out["1"][0]["next"] = _next_epoch(loaders)
    return out


def _seen(ranks: list[dict[str, Any]], name: str, *parts: str) -> list[int]:
    return [i for r in ranks for part in parts for i in _ids(r[part].get(name, []), name)]


def _epoch_ids(name: str) -> Counter[int]:
    return Counter(range(sum(FILE_TOKENS) if name == "stream" else SAMPLES))


@pytest.mark.parametrize("world", ["1", "2", "3"])
@pytest.mark.parametrize("name", [*MAP_CASES, "stream"])
def test_every_sample_once_across_the_resize(
    runs: dict[str, list[dict[str, Any]]], world: str, name: str
) -> None:
    before = _seen(runs["saved"], name, "before")
    after = _seen(runs[world], name, "first", "rest")
    carried = [t for r in runs[world] for t in r["carried"]] if name == "stream" else []
    assert len(before) == STEPS * BATCH * 2 * (TOKENS_PER_SAMPLE if name == "stream" else 1)
    assert Counter(before + after + carried) == _epoch_ids(name)
    if name != "stream":  # the rest of the epoch split evenly over the new ranks
        counts = [len(_seen([r], name, "first", "rest")) for r in runs[world]]
        assert counts == [(SAMPLES - len(before)) // int(world)] * int(world)


@pytest.mark.parametrize("name", [*MAP_CASES, "stream"])
def test_a_second_resize_inside_the_rest_of_the_epoch(
    runs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    """2 ranks, then 3 (saving inside the rest of the epoch), then 2 again."""
    before = _seen(runs["saved"], name, "before") + _seen(runs["3"], name, "first")
    after = _seen(runs["3->2"], name, "rest")
    carried = [t for r in runs["3->2"] for t in r["carried"]] if name == "stream" else []
    assert Counter(before + after + carried) == _epoch_ids(name)


@pytest.mark.parametrize("name", [*MAP_CASES, "stream"])
def test_the_saved_world_goes_on_as_the_uninterrupted_run(
    runs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    """Bitwise the same next batches, from the first save (2 ranks) and from the second (3
    ranks, inside the rest of an epoch split after a resize)."""
    for rank in range(2):
        resumed, uninterrupted = runs["2"][rank]["rest"][name], runs["saved"][rank]["after"][name]
        assert len(resumed) == len(uninterrupted)
        assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True))
    for rank in range(3):
        resumed, uninterrupted = runs["3->3"][rank]["rest"][name], runs["3"][rank]["rest"][name]
        assert len(resumed) == len(uninterrupted)
        assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True))


@pytest.mark.parametrize("world", ["1", "2", "3"])
def test_the_next_epoch_is_the_samplers_own(
    runs: dict[str, list[dict[str, Any]]], world: str
) -> None:
    """After the rest of a resumed epoch, epoch 1 is what the user's sampler gives each rank."""
    n = len(runs[world])
    for rank, r in enumerate(runs[world]):
        sampler = DistributedSampler(range(SAMPLES), n, rank, seed=5)
        sampler.set_epoch(1)
        assert r["next"]["distributed"] == list(sampler)
    for rank, r in enumerate(runs[world]):
        ours = ReshardableSampler(SAMPLES, seed=7, rank=rank, world_size=n)
        ours.set_epoch(1)
        assert r["next"]["reshardable"] == list(ours)


class _Counter(IterableDataset[int]):
    """An iterable dataset whose position is per rank and has no resharding function."""

    def __init__(self) -> None:
        self.next = 0

    def __iter__(self) -> Any:
        while self.next < 10:
            self.next += 1
            yield self.next - 1

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"]


def _saved_positions(
    world: int, steps: list[int], num_workers: int = 0, read: list[int] | None = None
) -> list[dict[str, Any]]:
    """The position values of ``world`` simulated ranks of a DistributedSampler loader, each
    having read ``steps[rank]`` batches (their sample ids added to ``read``)."""
    saved = []
    for rank in range(world):
        sampler = DistributedSampler(range(SAMPLES), world, rank, seed=1)
        loader = StatefulDataLoader(
            Squares(), sampler=sampler, batch_size=BATCH, num_workers=num_workers
        )
        data = reshardable(loader, rank=rank, world_size=world)
        batches = iter(data)
        for _ in range(steps[rank]):
            if read is not None:
                read += next(batches)[:, 0].tolist()
            else:
                next(batches)
        saved.append(data.state_dict()["position"].value)
    return saved


def test_an_iterable_position_without_a_resharding_function_is_refused() -> None:
    saved = []
    for rank in range(2):
        data = reshardable(StatefulDataLoader(_Counter(), batch_size=2), rank=rank, world_size=2)
        next(iter(data))
        saved.append(data.state_dict()["position"].value)
    resumed = reshardable(StatefulDataLoader(_Counter(), batch_size=2), rank=0, world_size=3)
    with pytest.raises(unickpt.CheckpointMismatchError, match="no resharding function"):
        resumed.reshard(saved, 3, 0)


def test_ranks_at_different_steps_are_refused() -> None:
    saved = _saved_positions(2, [3, 2])
    resumed = reshardable(
        StatefulDataLoader(Squares(), sampler=DistributedSampler(range(SAMPLES), 3, 0)),
        rank=0,
        world_size=3,
    )
    with pytest.raises(unickpt.CheckpointMismatchError, match="rank 0: epoch 0, 12 consumed"):
        resumed.reshard(saved, 3, 0)


def test_workers_resume_where_they_stopped(tmp_path: Path) -> None:
    """A loader with 2 workers (torchdata's snapshots of them in the state) goes on bitwise."""

    def build() -> ReshardableLoader:
        sampler = DistributedSampler(range(SAMPLES), 1, 0, seed=9)
        loader = StatefulDataLoader(Squares(), sampler=sampler, batch_size=BATCH, num_workers=2)
        return reshardable(loader)

    data = build()
    batches = iter(data)
    before = [next(batches) for _ in range(STEPS)]
    unickpt.save(str(tmp_path / "w"), {"data": data})
    uninterrupted = list(batches)
    resumed = build()
    unickpt.load(str(tmp_path / "w"), {"data": resumed})
    after = list(resumed)
    assert len(after) == len(uninterrupted) == SAMPLES // BATCH - STEPS
    assert all(torch.equal(a, b) for a, b in zip(after, uninterrupted, strict=True))
    assert sorted(_ids(before + after, "distributed")) == list(range(SAMPLES))


def test_processes_of_one_data_parallel_rank_count_once() -> None:
    """With tensor parallel 2, two processes save each data-parallel rank's position: the
    rest of the epoch is split as from the data-parallel ranks alone."""
    saved = _saved_positions(2, [3, 3])
    resumed = reshardable(
        StatefulDataLoader(Squares(), sampler=DistributedSampler(range(SAMPLES), 3, 0)),
        rank=0,
        world_size=3,
    )
    doubled = [saved[0], saved[0], saved[1], saved[1]]
    assert resumed.reshard(doubled, 6, 0) == resumed.reshard(saved, 3, 0)
    assert resumed.reshard(saved, 3, 0)["consumed"] == 3 * BATCH * 2
    with pytest.raises(unickpt.CheckpointMismatchError, match=r"ranks \[0\] of 2"):
        resumed.reshard(saved[:1], 3, 0)


def test_workers_read_the_rest_of_the_epoch_after_a_resize() -> None:
    """2 ranks with 2 workers each resumed on 3 ranks with 2 workers each (the loader of the
    rest of the epoch is built like the user's): every sample once. Ranks simulated here."""
    read: list[int] = []
    saved = _saved_positions(2, [STEPS, STEPS], num_workers=2, read=read)
    for rank in range(3):
        sampler = DistributedSampler(range(SAMPLES), 3, rank, seed=1)
        loader = StatefulDataLoader(Squares(), sampler=sampler, batch_size=BATCH, num_workers=2)
        data = reshardable(loader, rank=rank, world_size=3)
        data.load_state_dict({"position": unickpt.PerRank(data.reshard(saved, 3, rank))})
        assert data._rest is not None and data._rest.num_workers == 2
        read += [i for batch in data for i in batch[:, 0].tolist()]
    assert Counter(read) == Counter(range(SAMPLES))
