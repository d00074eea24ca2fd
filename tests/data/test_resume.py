"""A data-parallel run saved at step k on 4 ranks, resumed on 2, 3 and 4 ranks.

Real gloo ranks iterate a :class:`ReshardableSampler` through a torch DataLoader and a
:class:`ShardedStream` over token files, save both with ``unickpt.save`` at step k and go on to
the end; runs of 2, 3 and 4 ranks load that checkpoint and go to the end. Over each whole run
every sample index and every token is consumed exactly once (the stream's last carried tokens,
too few for a sample, counted as left), and on 4 ranks each rank goes on as the uninterrupted
run did.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import unickpt
from tests.distributed import run_ranks
from unickpt.data import ReshardableSampler, ShardedStream

SAMPLES = 100  # 5 steps of 2 per rank on 4 ranks, then 60 left: a whole number per rank on 2, 3, 4
BATCH = 2
STEP_K = 5
TOKENS_PER_SAMPLE = 8
FILE_TOKENS = [37, 50, 23, 61, 44, 29, 55, 40]  # files not cut at sample boundaries


def _write_sources(folder: Path) -> list[str]:
    paths, start = [], 0
    for i, n in enumerate(FILE_TOKENS):
        path = folder / f"shard-{i:02d}.bin"
        np.arange(start, start + n, dtype=np.uint16).tofile(path)
        paths.append(str(path))
        start += n
    return paths


def _reader(rank: int, world: int, sources: list[str]) -> tuple[Any, ShardedStream]:
    sampler = ReshardableSampler(SAMPLES, shuffle=True, seed=7, rank=rank, world_size=world)
    stream = ShardedStream(
        sources, rank=rank, world_size=world, tokens_per_sample=TOKENS_PER_SAMPLE
    )
    return sampler, stream


def _loader(sampler: ReshardableSampler) -> DataLoader[Any]:
    return DataLoader(list(range(SAMPLES)), sampler=sampler, batch_size=BATCH)


def _drain(sampler: ReshardableSampler, stream: ShardedStream) -> dict[str, list[int]]:
    """Everything left of the epoch and of the stream, as each is consumed."""
    indices: list[int] = []
    for batch in _loader(sampler):
        indices += batch.tolist()
        sampler.advance(len(batch))
    tokens = [t for sample in stream for t in sample.tolist()]
    return {"indices": indices, "tokens": tokens, "carried": stream.carried.tolist()}


def _train_and_save(rank: int, world: int, sources: list[str], path: str) -> dict[str, Any]:
    sampler, stream = _reader(rank, world, sources)
    sampler.set_epoch(0)
    batches, samples = iter(_loader(sampler)), iter(stream)
    before: dict[str, list[int]] = {"indices": [], "tokens": []}
    for _ in range(STEP_K):
        batch = next(batches)
        before["indices"] += batch.tolist()
        sampler.advance(len(batch))
        before["tokens"] += next(samples).tolist()
    unickpt.save(path, {"sampler": sampler, "stream": stream})
    # the rest, as the uninterrupted run goes on (a new DataLoader iterator: the same order)
    after = _drain(sampler, stream)
    return {"before": before, "after": after}


def _resume(rank: int, world: int, sources: list[str], path: str) -> dict[str, Any]:
    sampler, stream = _reader(rank, world, sources)
    unickpt.load(path, {"sampler": sampler, "stream": stream})
    sampler.set_epoch(0)  # the loop resumes in the saved epoch: the position is kept
    return _drain(sampler, stream)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("data")
    sources = _write_sources(folder)
    path = str(folder / "step-k")
    out: dict[int, list[dict[str, Any]]] = {0: run_ranks(4, _train_and_save, sources, path)}
    for world in (2, 3, 4):
        out[world] = run_ranks(world, _resume, sources, path)
    return out


def _before(runs: dict[int, list[dict[str, Any]]], what: str) -> list[int]:
    return [x for r in runs[0] for x in r["before"][what]]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sampler_consumes_every_index_once(
    runs: dict[int, list[dict[str, Any]]], world: int
) -> None:
    after = [x for r in runs[world] for x in r["indices"]]
    assert len(_before(runs, "indices")) == STEP_K * BATCH * 4
    assert Counter(_before(runs, "indices") + after) == Counter(range(SAMPLES))
    assert [len(r["indices"]) for r in runs[world]] == [60 // world] * world


@pytest.mark.parametrize("world", [2, 3, 4])
def test_stream_consumes_every_token_once(
    runs: dict[int, list[dict[str, Any]]], world: int
) -> None:
    after = [x for r in runs[world] for x in r["tokens"] + r["carried"]]
    assert all(len(r["carried"]) < TOKENS_PER_SAMPLE for r in runs[world])
    assert Counter(_before(runs, "tokens") + after) == Counter(range(sum(FILE_TOKENS)))
    assert all(len(r["tokens"]) % TOKENS_PER_SAMPLE == 0 and r["tokens"] for r in runs[world])


def test_four_ranks_go_on_as_the_uninterrupted_run(runs: dict[int, list[dict[str, Any]]]) -> None:
    for rank in range(4):
        assert runs[4][rank] == runs[0][rank]["after"]


def test_sampler_matches_torch_distributed_sampler_from_the_start() -> None:
    """From an epoch's start, the ranks take the indices DistributedSampler gives them."""
    from torch.utils.data.distributed import DistributedSampler

    for world in (1, 3, 4):
        for rank in range(world):
            ours = ReshardableSampler(10, seed=3, rank=rank, world_size=world)
            theirs = DistributedSampler(range(10), world, rank, seed=3)
            ours.set_epoch(2)
            theirs.set_epoch(2)
            assert list(ours) == list(theirs)


@pytest.mark.parametrize("first,second", [(4, 3), (3, 2), (2, 5), (1, 4), (5, 1)])
def test_sampler_resumes_exactly_on_any_world_size(first: int, second: int) -> None:
    """Ranks simulated in one process: k steps on ``first`` ranks, the rest on ``second``; only
    the padding of the epoch's last step repeats an index."""
    n, steps = 23, 2
    ranks = [ReshardableSampler(n, seed=1, rank=r, world_size=first) for r in range(first)]
    used = [i for s in ranks for i in list(s)[: steps * BATCH]]
    for s in ranks:
        s.advance(steps * BATCH)
    state = ranks[0].state_dict()
    assert state["consumed"] == steps * BATCH * first
    rest = []
    for r in range(second):
        resumed = ReshardableSampler(n, seed=1, rank=r, world_size=second)
        resumed.load_state_dict(state)
        rest += list(resumed)
    padding = -(n - len(used)) % second
    assert sorted(set(used + rest)) == list(range(n))
    assert len(used + rest) == n + padding


def test_a_sampler_of_another_dataset_refuses_the_position() -> None:
    saved = ReshardableSampler(10, rank=0, world_size=1).state_dict()
    other = ReshardableSampler(12, rank=0, world_size=1)
    with pytest.raises(unickpt.CheckpointMismatchError, match="dataset_len=10"):
        other.load_state_dict(saved)


def test_stream_position_names_sources_it_does_not_have(tmp_path: Path) -> None:
    sources = _write_sources(tmp_path)
    stream = ShardedStream(sources, rank=0, world_size=1, tokens_per_sample=4)
    state = stream.state_dict()
    fewer = ShardedStream(sources[:2], rank=0, world_size=1, tokens_per_sample=4)
    with pytest.raises(unickpt.CheckpointMismatchError, match=r"shard-02\.bin"):
        fewer.load_state_dict(state)


def test_stream_yields_int64_samples_across_file_ends(tmp_path: Path) -> None:
    sources = _write_sources(tmp_path)[:2]  # 37 + 50 tokens
    stream = ShardedStream(sources, rank=0, world_size=1, tokens_per_sample=TOKENS_PER_SAMPLE)
    samples = list(stream)
    assert all(s.dtype == torch.int64 for s in samples)
    assert torch.equal(torch.cat(samples), torch.arange(80))
    assert stream.carried.tolist() == list(range(80, 87))


def test_stream_redistributes_carried_tokens_and_cursors(tmp_path: Path) -> None:
    """Two ranks over two int32 files of 10 tokens: rank 0 read its file to the end (2 tokens
    carried), rank 1 one sample of its own; on 3 ranks, rank 0 takes the carried tokens and
    the file left, and goes on with them."""
    paths = [str(tmp_path / f"big-{i}.bin") for i in range(2)]
    for i, p in enumerate(paths):
        np.arange(100_000 * i, 100_000 * i + 10, dtype=np.int32).tofile(p)
    first, second = (
        ShardedStream(paths, rank=r, world_size=2, tokens_per_sample=4, dtype=np.int32)
        for r in range(2)
    )
    assert [s.tolist() for s in first] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert next(iter(second)).tolist() == [100_000, 100_001, 100_002, 100_003]
    saved = [s.state_dict()["position"].value for s in (first, second)]
    parts = [unickpt.data.redistribute(saved, 3, r) for r in range(3)]
    assert [p["cursors"] for p in parts] == [[[paths[1], 4, 10]], [], []]
    assert [p["carried"].tolist() for p in parts] == [[8, 9], [], []]
    resumed = ShardedStream(paths, rank=0, world_size=3, tokens_per_sample=4, dtype=np.int32)
    resumed.load_state_dict({"position": unickpt.PerRank(parts[0])})
    assert [s.tolist() for s in resumed] == [
        [8, 9, 100_004, 100_005],
        [100_006, 100_007, 100_008, 100_009],
    ]
