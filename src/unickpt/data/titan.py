"""torchtitan's data loader resumed on another data-parallel degree.

torchtitan saves a ``ParallelAwareDataloader``'s state per rank (``dp_rank_N``: its
StatefulDataLoader's state, pickled) and refuses another degree. Its Hugging Face text dataset
over a map-style ``datasets.Dataset`` gives rank ``r`` of ``N`` the contiguous shard of documents
``split_dataset_by_node`` makes, read in order in epoch 0 and shuffled (``seed=42 + epoch``) in
later ones; a rank's state is the documents of its pass read (``sample_idx``), the epoch and the
tokens read but not yet yielded (the buffers).

The rule on another degree, exact: the documents the job read of the epoch are known (each saving
rank's first ``sample_idx`` documents of its pass); every new rank reads the documents of its own
new shard, in the epoch's order, that the job had not read; the buffers of saving rank ``r`` go to
new rank ``r % M``. So over the whole epoch every document is read once, though the new ranks may
have unequal shares left. The documents read before the pass ride along in each rank's saved
state until the epoch ends, so a later save resumes exactly too, on any degree. Refused with
:class:`unickpt.CheckpointMismatchError`: a streaming (iterable) Hugging Face dataset (its
position in a stream's shards does not split), other datasets, data loader workers, saving ranks
in different epochs.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointMismatchError
from ..layouts.leaves import PerRank

log = logging.getLogger(__name__)

SHUFFLE_SEED = 42  # torchtitan's HuggingFaceTextDataset shuffles epoch e with seed 42 + e
_EXCLUDE = 'list "dataloader" in checkpoint.exclude_from_loading to start the data over'


class TitanLoaderState:
    """A torchtitan data loader in a unickpt state: its own per-rank state under ``state``, a
    :class:`unickpt.PerRank` value that :func:`reshard_titan_loader` gathers when the world size
    changed, for :meth:`load_state_dict` to take this data-parallel rank's share of."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader
        self.read: dict[str, Any] | None = None  # documents read before this pass, in its epoch

    def state_dict(self) -> dict[str, Any]:
        value = dict(self.dataloader.state_dict())
        value["unickpt"] = _position(self.dataloader, self.read)
        return {"state": PerRank(value, on_world_change=reshard_titan_loader)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        value = dict(state_dict["state"].value)
        if "resharded" in value:
            self.read = _load_resharded(self.dataloader, value["resharded"])
            return
        _check_degree(self.dataloader, value)
        ours = value.pop("unickpt", None)
        read = ours.get("read") if ours else None
        self.read = read
        if read is None:
            self.dataloader.load_state_dict(value)
        else:
            _load_inside_pass(self.dataloader, value, read)


def reshard_titan_loader(saved: list[dict[str, Any]], world_size: int, rank: int) -> Any:
    """Every saving data-parallel rank's position gathered (the same on every loading rank):
    the documents of the epoch the job read, the buffers of each saving DP rank."""
    positions = _saved_positions(saved)
    epochs = sorted({p["epoch"] for p in positions})
    if len(epochs) > 1:
        raise CheckpointMismatchError(
            f"the torchtitan data loader's saving ranks were in epochs {epochs}; unickpt reshards "
            f"a position inside one epoch. Load on {len(positions)} data-parallel ranks, or "
            f"{_EXCLUDE}."
        )
    epoch, dataset_len = epochs[0], sum(p["shard_len"] for p in positions)
    read = _read_documents(positions, epoch, dataset_len)
    log.info(
        "torchtitan data loader resharded from %d data-parallel ranks: %d of %d documents of "
        "epoch %d read",
        len(positions),
        len(read),
        dataset_len,
        epoch,
    )
    return {
        "resharded": {
            "epoch": epoch,
            "ranges": _ranges(read),
            "dataset_len": dataset_len,
            "buffers": [p["buffers"] for p in positions],
        }
    }


_BUFFERS = ("inputs_buffer", "labels_buffer", "positions_buffer")


# -- save ------------------------------------------------------------------------------------


def _position(dataloader: Any, read: dict[str, Any] | None) -> dict[str, Any] | None:
    """What resharding needs beside torchtitan's own state: the length of this rank's shard
    of a map-style dataset and the documents read before this pass (while in its epoch);
    None for another dataset."""
    dataset: Any = getattr(dataloader, "dataset", None)
    if not _is_map_style(getattr(dataset, "_original_data", None)):
        return None
    shard = dataset._original_data
    current = read if read is not None and read["epoch"] == dataset._epoch else None
    return {"shard_len": len(shard), "read": current}


def _shard(dataset_len: int, world: int, rank: int) -> tuple[int, int]:
    """Documents ``[start, stop)`` of rank ``rank`` (``datasets.Dataset.shard(contiguous)``)."""
    div, mod = divmod(dataset_len, world)
    start = div * rank + min(rank, mod)
    return start, start + div + (1 if rank < mod else 0)


# -- reshard ---------------------------------------------------------------------------------


def _saved_positions(saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each saving data-parallel rank's position, in DP rank order (ranks of one DP rank, as
    tensor-parallel ones, hold the same); refused where one is unknown or missing."""
    by_rank: dict[int, dict[str, Any]] = {}
    for value in saved:
        for key in value:
            if key.startswith("dp_rank_"):
                by_rank.setdefault(int(key.removeprefix("dp_rank_")), value)
    degree = int(saved[0].get("world_size", len(by_rank)))
    if sorted(by_rank) != list(range(degree)):
        raise CheckpointMismatchError(
            f"the checkpoint holds the torchtitan data loader of data-parallel ranks "
            f"{sorted(by_rank)} of {degree}; resharding needs every one's. Load on {degree} "
            f"data-parallel ranks, or {_EXCLUDE}."
        )
    return [_saved_position(by_rank[r], r) for r in range(degree)]


def _saved_position(value: dict[str, Any], rank: int) -> dict[str, Any]:
    """A saving DP rank's epoch, shard, documents read and buffers; refused where unknown."""
    ours = value.get("unickpt")
    raw = value.get(f"dp_rank_{rank}")
    state = pickle.loads(raw) if ours is not None and isinstance(raw, bytes) else None
    known = state is not None and "sample_idx" in (state.get("dataset_state") or {})
    if ours is None or state is None or "_snapshot" in state or not known:
        why = (
            "was read by data loader workers"
            if state is not None and "_snapshot" in state
            else "is not a map-style Hugging Face text dataset saved by this version"
        )
        raise CheckpointMismatchError(
            f"the torchtitan data loader of saving data-parallel rank {rank} {why}; unickpt "
            "reshards the position of torchtitan's HuggingFaceTextDataset over a map-style "
            "dataset, read without workers (a stream's position in its shards does not "
            f"split). Load on {value.get('world_size')} data-parallel ranks, or {_EXCLUDE}."
        )
    dataset_state = state["dataset_state"]
    read = ours["read"]
    return {
        "epoch": int(dataset_state.get("epoch", 0)),
        "sample_idx": int(dataset_state["sample_idx"]),
        "shard_len": int(ours["shard_len"]),
        "read": _ids(read["ranges"]) if read is not None else np.zeros(0, dtype=np.int64),
        "buffers": {k: list(dataset_state.get(k, [])) for k in _BUFFERS},
    }


def _read_documents(positions: list[dict[str, Any]], epoch: int, dataset_len: int) -> np.ndarray:
    """The documents of ``epoch`` the saving ranks read, sorted."""
    parts, start = [p["read"] for p in positions], 0
    for p in positions:
        order = _pass(epoch_order(start, p["shard_len"], epoch), p["read"])
        parts.append(order[: p["sample_idx"]])
        start += p["shard_len"]
    read = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
    assert len(read) <= dataset_len
    return read


def epoch_order(start: int, length: int, epoch: int) -> np.ndarray:
    """The documents of shard ``[start, start + length)`` in the order torchtitan reads them
    in ``epoch``: in order in epoch 0, shuffled by ``datasets`` with ``42 + epoch`` after."""
    ids = np.arange(start, start + length, dtype=np.int64)
    if epoch == 0:
        return ids
    from datasets import Dataset  # torchtitan's own dependency

    shuffled = Dataset.from_dict({"i": ids}).shuffle(seed=SHUFFLE_SEED + epoch)
    return np.asarray(shuffled["i"], dtype=np.int64)


def _pass(order: np.ndarray, read: np.ndarray) -> np.ndarray:
    """The documents of ``order`` not read before the pass, in order."""
    return order[~np.isin(order, read)] if len(read) else order


def _ranges(ids: np.ndarray) -> torch.Tensor:
    """Sorted document ids as ``[start, stop)`` rows (compact where reads are runs)."""
    if len(ids) == 0:
        return torch.zeros((0, 2), dtype=torch.int64)
    breaks = np.nonzero(np.diff(ids) != 1)[0]
    starts = np.concatenate([[ids[0]], ids[breaks + 1]])
    stops = np.concatenate([ids[breaks] + 1, [ids[-1] + 1]])
    return torch.from_numpy(np.stack([starts, stops], axis=1).astype(np.int64))


def _ids(ranges: Any) -> np.ndarray:
    rows = torch.as_tensor(ranges, dtype=torch.int64).reshape(-1, 2).tolist()
    if not rows:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in rows])


# -- load ------------------------------------------------------------------------------------


def _load_resharded(dataloader: Any, value: dict[str, Any]) -> dict[str, Any]:
    """Start this DP rank's pass over what is left of the epoch in its new shard, with the
    buffers of the saving DP ranks ``r`` where ``r % degree`` is this one."""
    dataset = _map_dataset(dataloader)
    rank, degree = int(dataloader.dp_rank), int(dataloader.dp_world_size)
    mine = [b for r, b in enumerate(value["buffers"]) if r % degree == rank]
    state: dict[str, Any] = {k: [t for b in mine for t in b[k]] for k in _BUFFERS}
    dataset._data = dataset._original_data
    dataset.load_state_dict({**state, "sample_idx": 0, "epoch": int(value["epoch"])})
    read = {k: value[k] for k in ("epoch", "ranges", "dataset_len")}
    _select_pass(dataloader, dataset, read)
    _drop_iterator(dataloader)
    return read


def _load_inside_pass(dataloader: Any, value: dict[str, Any], read: dict[str, Any]) -> None:
    """Resume a pass that began after a reshard: torchtitan's state, then the same pass."""
    dataset = _map_dataset(dataloader)
    state = pickle.loads(value[f"dp_rank_{dataloader.dp_rank}"])
    dataset._data = dataset._original_data
    dataset.load_state_dict(state["dataset_state"])
    _select_pass(dataloader, dataset, read)
    from torchdata.stateful_dataloader import StatefulDataLoader

    StatefulDataLoader.load_state_dict(dataloader, {**state, "dataset_state": None})


def _select_pass(dataloader: Any, dataset: Any, read: dict[str, Any]) -> None:
    """Narrow the dataset's current epoch order to the documents not read before the pass."""
    degree, rank = int(dataloader.dp_world_size), int(dataloader.dp_rank)
    start, stop = _shard(int(read["dataset_len"]), degree, rank)
    if stop - start != len(dataset._original_data):
        raise CheckpointMismatchError(
            f"this data-parallel rank's shard holds {len(dataset._original_data)} documents, "
            f"but a dataset of {read['dataset_len']} (the saved run's) gives it {stop - start}; "
            f"build the data loader over the saved run's dataset, or {_EXCLUDE}."
        )
    order = epoch_order(start, stop - start, int(read["epoch"]))
    keep = np.nonzero(~np.isin(order, _ids(read["ranges"])))[0]
    dataset._data = dataset._data.select(keep.tolist())


def _check_degree(dataloader: Any, value: dict[str, Any]) -> None:
    """The same world size but another data-parallel degree (another tensor-parallel one): this
    rank holds only its own saved state, which is no other DP rank's."""
    saved = value.get("world_size")
    degree = getattr(dataloader, "dp_world_size", saved)
    if saved is not None and saved != degree:
        raise CheckpointMismatchError(
            f"the torchtitan data loader was saved on {saved} data-parallel ranks and loads on "
            f"{degree} in a job of as many processes; unickpt reshards it when the number of "
            f"processes changes. Load with {saved} data-parallel ranks, or {_EXCLUDE}."
        )


def _drop_iterator(dataloader: Any) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    StatefulDataLoader.load_state_dict(dataloader, {})


def _is_map_style(data: Any) -> bool:
    """Whether ``data`` is a map-style ``datasets.Dataset`` (not a streaming one)."""
    if data is None:
        return False
    from datasets import Dataset  # torchtitan's own dependency

    return isinstance(data, Dataset)


def _map_dataset(dataloader: Any) -> Any:
    dataset = getattr(dataloader, "dataset", None)
    if not _is_map_style(getattr(dataset, "_original_data", None)) or dataloader.num_workers:
        raise CheckpointMismatchError(
            f"the checkpoint's torchtitan data loader position belongs to a map-style Hugging "
            f"Face text dataset read without workers, but this data loader reads a "
            f"{type(dataset).__name__} with {dataloader.num_workers} workers; build the data "
            f"loader as the saved run did, or {_EXCLUDE}."
        )
    return dataset
