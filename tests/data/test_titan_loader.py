"""torchtitan's Hugging Face text data loader through UnickptCheckpointManager, saved on 2
data-parallel ranks and resumed on 1, 2 and 3.

Each rank builds torchtitan's ``HuggingFaceTextDataLoader`` over a local map-style dataset of 40
documents (document ``d`` is the tokens ``100 * d + j``, of lengths 3 to 13), reads 3 batches,
saves through the manager at step 3 and reads to the end of the epoch. Runs of 3, 2 and 1 ranks
load step 3 and read to the end; the 3-rank run saves step 5 inside its pass, which it and the
2-rank run load in turn. Over each whole run every input token of the epoch is yielded once or
left in a rank's buffer at the end (too few for a sample); at the saved degree the batches go on
as the uninterrupted run's, bitwise.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from tests.distributed import run_ranks

pytest.importorskip("torchtitan")
pytest.importorskip("datasets")

DOCS = 40
SEQ = 8
BATCH = 2
STEPS = 3
SECOND_STEP = 5  # the 3-rank run saves 2 batches into its pass


def _tokens(doc: int) -> list[int]:
    return [100 * doc + j for j in range(3 + (doc * 7) % 11)]


class DocTokenizer:
    """``"doc d"`` to document ``d``'s tokens (bos and eos are its first and last)."""

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return _tokens(int(text.split()[1]))


def _write_dataset(folder: Path) -> str:
    path = folder / "docs"
    path.mkdir()
    with open(path / "train.jsonl", "w") as f:
        for d in range(DOCS):
            f.write(json.dumps({"text": f"doc {d}"}) + "\n")
    return str(path)


class _Job:
    """A manager with a data loader and a one-layer model (what the loader needs around it)."""

    def __init__(self, rank: int, world: int, folder: str, data: str) -> None:
        import datasets
        from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

        from unickpt.integrations.torchtitan import UnickptCheckpointManager

        datasets.config.HF_DATASETS_CACHE = f"{folder}/hf-cache-{world}-{rank}"
        config = HuggingFaceTextDataLoader.Config(
            dataset="c4_test", dataset_path=data, infinite=False
        )
        self.loader = HuggingFaceTextDataLoader(
            config,
            dp_world_size=world,
            dp_rank=rank,
            tokenizer=DocTokenizer(),
            seq_len=SEQ,
            local_batch_size=BATCH,
        )
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = UnickptCheckpointManager.Config(enable=True, folder="ckpt", interval=1)
        self.manager = manager.build(
            dataloader=self.loader,
            model_parts=[model],
            optimizers=optimizer,
            lr_schedulers=torch.optim.lr_scheduler.StepLR(optimizer, 1),
            states={},
            base_folder=folder,
        )

    def buffer(self) -> list[int]:
        return list(self.loader.dataset._inputs_buffer)


def _inputs(batches: list[Any]) -> list[torch.Tensor]:
    return [torch.stack([b[0]["input"], b[0]["positions"], b[1]]) for b in batches]


def _save_run(rank: int, world: int, folder: str, data: str) -> dict[str, Any]:
    job = _Job(rank, world, folder, data)
    batches = iter(job.loader)
    before = _inputs([next(batches) for _ in range(STEPS)])
    job.manager.save(STEPS)
    after = _inputs(list(batches))
    job.manager.close()
    return {"before": before, "after": after, "buffer": job.buffer()}


def _resume(rank: int, world: int, folder: str, data: str, save_second: bool) -> dict[str, Any]:
    job = _Job(rank, world, folder, data)
    assert job.manager.load(step=STEPS)
    batches = iter(job.loader)
    first = []
    if save_second:
        first = _inputs([next(batches) for _ in range(SECOND_STEP - STEPS)])
        job.manager.save(SECOND_STEP)
    out = {"first": first, "rest": _inputs(list(batches)), "buffer": job.buffer()}
    job.manager.close()
    again = _Job(rank, world, folder, data)
    assert again.manager.load(step=SECOND_STEP)
    out["second"] = {"rest": _inputs(list(again.loader)), "buffer": again.buffer()}
    again.manager.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("titan-loader")
    data = _write_dataset(folder)
    out = {"saved": run_ranks(2, _save_run, str(folder), data)}
    out["3"] = run_ranks(3, _resume, str(folder), data, True)
    out["2"] = run_ranks(2, _resume, str(folder), data, False)
    out["1"] = [_resume(0, 1, str(folder), data, False)]  # one rank: in this process
    out["3->3"] = [r["second"] for r in out["3"]]
    out["3->2"] = [r["second"] for r in out["2"]]
    return out


def _yielded(ranks: list[dict[str, Any]], *parts: str) -> list[int]:
    return [t for r in ranks for p in parts for b in r[p] for t in b[0].flatten().tolist()]


def _epoch() -> Counter[int]:
    """Every input token of the epoch (a document's last token is only a label)."""
    return Counter(t for d in range(DOCS) for t in _tokens(d)[:-1])


@pytest.mark.parametrize("world", ["1", "2", "3"])
def test_every_token_once_across_the_resize(
    runs: dict[str, list[dict[str, Any]]], world: str
) -> None:
    before = _yielded(runs["saved"], "before")
    after = _yielded(runs[world], "first", "rest")
    left = [t for r in runs[world] for t in r["buffer"]]
    assert len(before) == STEPS * BATCH * SEQ * 2
    assert all(len(r["buffer"]) < SEQ for r in runs[world])
    assert Counter(before + after + left) == _epoch()


def test_two_then_three_then_two(runs: dict[str, list[dict[str, Any]]]) -> None:
    before = _yielded(runs["saved"], "before") + _yielded(runs["3"], "first")
    after = _yielded(runs["3->2"], "rest")
    left = [t for r in runs["3->2"] for t in r["buffer"]]
    assert Counter(before + after + left) == _epoch()


def test_the_saved_degree_goes_on_as_the_uninterrupted_run(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    for rank in range(2):
        resumed, uninterrupted = runs["2"][rank]["rest"], runs["saved"][rank]["after"]
        assert len(resumed) == len(uninterrupted) > 0
        assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True))
    for rank in range(3):
        resumed, uninterrupted = runs["3->3"][rank]["rest"], runs["3"][rank]["rest"]
        assert len(resumed) == len(uninterrupted) > 0
        assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True))


def test_a_stream_position_is_refused(tmp_path: Path) -> None:
    """A streaming Hugging Face dataset's position (in its stream's shards) is refused on
    another degree, naming exclude_from_loading; so is a state of no known dataset."""
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from unickpt.data.titan import TitanLoaderState, reshard_titan_loader

    data = _write_dataset(tmp_path)
    DATASETS["docs_stream"] = DatasetConfig(
        path=data,
        loader=lambda path: load_dataset(path, split="train", streaming=True),
        sample_processor=lambda sample: sample["text"],
    )
    try:
        saved = []
        for rank in range(2):
            loader = _loader_at(rank, 2, str(tmp_path), data, dataset="docs_stream")
            next(iter(loader))
            saved.append(TitanLoaderState(loader).state_dict()["state"].value)
    finally:
        del DATASETS["docs_stream"]
    with pytest.raises(unickpt.CheckpointMismatchError, match=r"stream.*exclude_from_loading"):
        reshard_titan_loader(saved, 3, 0)
    other = [{"dp_rank_0": b"", "world_size": 1, "unickpt": None}]
    with pytest.raises(unickpt.CheckpointMismatchError, match="exclude_from_loading"):
        reshard_titan_loader(other, 2, 0)


def _loader_at(rank: int, world: int, folder: str, data: str, dataset: str = "c4_test") -> Any:
    """A data loader alone (no manager), for ranks simulated in this process."""
    import datasets
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    datasets.config.HF_DATASETS_CACHE = f"{folder}/hf-cache"
    config = HuggingFaceTextDataLoader.Config(dataset=dataset, dataset_path=data, infinite=False)
    return HuggingFaceTextDataLoader(
        config,
        dp_world_size=world,
        dp_rank=rank,
        tokenizer=DocTokenizer(),
        seq_len=SEQ,
        local_batch_size=BATCH,
    )


def test_a_shuffled_epoch_reshards_exactly(tmp_path: Path) -> None:
    """Epoch 1 (torchtitan shuffles each rank's shard): the order unickpt computes is the one
    the ranks read, and 2 ranks (as 4 processes with tensor parallel 2) resharded to 3 read
    every token of the epoch once. Ranks simulated in this process with their own loaders."""
    from unickpt.data.titan import TitanLoaderState, epoch_order, reshard_titan_loader

    data = _write_dataset(tmp_path)
    loaders = [_loader_at(r, 2, str(tmp_path), data) for r in range(2)]
    for rank, loader in enumerate(loaders):
        loader.dataset.reloop()  # epoch 1
        docs = [int(s["text"].split()[1]) for s in loader.dataset._data]
        assert docs == epoch_order(rank * DOCS // 2, DOCS // 2, 1).tolist() != sorted(docs)
    iterators = [iter(loader) for loader in loaders]
    before = [t for it in iterators for _ in range(STEPS) for t in next(it)[0]["input"].flatten()]
    saved = [TitanLoaderState(loader).state_dict()["state"].value for loader in loaders]
    after: list[int] = []
    for rank in range(3):
        share = reshard_titan_loader([saved[0], saved[0], saved[1], saved[1]], 6, 2 * rank)
        resumed = TitanLoaderState(_loader_at(rank, 3, str(tmp_path), data))
        resumed.load_state_dict({"state": unickpt.PerRank(share)})
        after += [t for b in resumed.dataloader for t in b[0]["input"].flatten().tolist()]
        after += resumed.dataloader.dataset._inputs_buffer
    assert Counter([int(t) for t in before] + after) == _epoch()


def test_saving_ranks_in_different_epochs_are_refused(tmp_path: Path) -> None:
    from unickpt.data.titan import TitanLoaderState, reshard_titan_loader

    data = _write_dataset(tmp_path)
    loaders = [_loader_at(r, 2, str(tmp_path), data) for r in range(2)]
    loaders[1].dataset.reloop()
    saved = [TitanLoaderState(loader).state_dict()["state"].value for loader in loaders]
    with pytest.raises(unickpt.CheckpointMismatchError, match=r"epochs \[0, 1\]"):
        reshard_titan_loader(saved, 3, 0)
