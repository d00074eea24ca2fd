"""torchdata's StatefulDataLoader, resumable on another number of data-parallel ranks.

:func:`reshardable` wraps a loader; iterate the wrapper and put it in the state. At the saved
world size each rank restores the loader's own state (torchdata's: the next batches are the
ones an uninterrupted run would have had). On another world size the state is resharded:

- a map-style dataset read through a ``DistributedSampler`` (torch's or torchdata's) or a
  :class:`~unickpt.data.ReshardableSampler`: every rank read the same number of batches of one
  epoch order, so the job consumed its first ``consumed`` positions; the rest of the epoch is
  split over the new ranks by a :class:`~unickpt.data.ReshardableSampler` in a loader built like
  the user's, and the next epoch goes back to the user's loader;
- an iterable dataset: its position is per rank, so it reshards only where the dataset's
  ``state_dict`` holds :class:`unickpt.PerRank` values with a function (as
  :class:`~unickpt.data.ShardedStream` does), each resharded by its function; any other state
  refuses the load (:class:`unickpt.CheckpointMismatchError`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from torch.utils.data import DistributedSampler

from ..errors import CheckpointMismatchError
from ..layouts.leaves import PerRank
from .sampler import ReshardableSampler, _rank_and_size

if TYPE_CHECKING:
    from torchdata.stateful_dataloader import StatefulDataLoader

log = logging.getLogger(__name__)

_PER_RANK_TAG = "$unickpt.per_rank"
# the StatefulDataLoader arguments a loader over the rest of an epoch shares with the user's
_LOADER_ARGS = (
    "batch_size",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
    "snapshot_every_n_steps",
)


@dataclass(frozen=True)
class EpochOrder:
    """What fixes an epoch's order of a map-style dataset's indices (as both samplers make it:
    ``torch.randperm`` seeded by ``seed + epoch``, or ``0..n-1``)."""

    dataset_len: int
    shuffle: bool
    seed: int
    drop_last: bool


def reshardable(
    loader: StatefulDataLoader, *, rank: int | None = None, world_size: int | None = None
) -> ReshardableLoader:
    """``loader`` resumable on any number of data-parallel ranks: iterate the result instead
    of ``loader`` and put it in the state. ``rank`` and ``world_size`` are the data-parallel
    ones (torch.distributed's when left out).

    >>> from torch.utils.data import DistributedSampler  # doctest: +SKIP
    >>> from torchdata.stateful_dataloader import StatefulDataLoader  # doctest: +SKIP
    >>> sampler = DistributedSampler(dataset, seed=0)  # doctest: +SKIP
    >>> data = unickpt.data.reshardable(
    ...     StatefulDataLoader(dataset, sampler=sampler, batch_size=8)
    ... )  # doctest: +SKIP
    >>> unickpt.load(path, {"model": model, "data": data})  # any world size  # doctest: +SKIP
    >>> sampler.set_epoch(epoch)  # the saved epoch: the loop resumes in it  # doctest: +SKIP
    >>> for batch in data:  # the rest of the epoch, then whole epochs  # doctest: +SKIP
    ...     step(batch)
    """
    return ReshardableLoader(loader, rank=rank, world_size=world_size)


class ReshardableLoader:
    """A StatefulDataLoader whose position reshards when the data-parallel world changes.

    Iterate it as the loader (``for batch in data``); each pass counts the batches it handed
    out, which is what training consumed (the loader's workers and prefetching fetch ahead, and
    are not counted). :meth:`state_dict` is a :class:`unickpt.PerRank` value, resharded on
    another world size by :meth:`reshard`. ``rank`` and ``world_size`` are the data-parallel
    ones (torch.distributed's when left out).
    """

    def __init__(
        self, loader: StatefulDataLoader, *, rank: int | None = None, world_size: int | None = None
    ) -> None:
        self.loader = loader
        self.rank, self.world_size = _rank_and_size(rank, world_size)
        self._rest: StatefulDataLoader | None = None  # the rest of an epoch after a resize
        self._base = 0  # positions of the epoch order consumed when this pass began
        self._yielded = 0  # batches this pass handed out
        self._epoch: int | None = None  # the epoch of this pass
        self._continues = False  # a loaded position: the next pass goes on with it

    # -- iteration ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        source = self._rest if self._rest is not None else self.loader
        if not self._continues:
            self._yielded = 0
            sampler = source.sampler
            self._base = sampler.consumed if isinstance(sampler, ReshardableSampler) else 0
            self._epoch = int(sampler.epoch) if _epoch_order(sampler) is not None else None
        self._continues = False
        for batch in source:
            self._yielded += 1
            yield batch
        self._rest = None

    def __len__(self) -> int:
        return len(self._rest if self._rest is not None else self.loader)

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's position, as a PerRank value that :meth:`reshard` splits anew."""
        source = self._rest if self._rest is not None else self.loader
        loader_state = source.state_dict()
        used_up = self._rest is not None and bool(loader_state.get("_iterator_finished"))
        if used_up:  # the rest of the epoch is used: the next pass is the user's loader's
            loader_state, source = self.loader.state_dict(), self.loader
        value = {
            "rank": self.rank,
            "world_size": self.world_size,
            "in_rest": self._rest is not None and not used_up,
            **self._map_position(source, used_up),
        }
        value["loader"] = None if self._resumes_by_position(value) else _tagged(loader_state)
        return {"position": PerRank(value, on_world_change=self.reshard)}

    def _map_position(self, source: StatefulDataLoader, used_up: bool) -> dict[str, Any]:
        """The job's position in this pass's epoch order (``consumed``: how many of its
        positions every rank together used), or ``order: None`` where the loader's sampler
        fixes none (an iterable dataset, another sampler)."""
        sampler = source.sampler
        order = _epoch_order(sampler)
        if order is None:
            return {"order": None}
        epoch = self._epoch if self._epoch is not None else int(getattr(sampler, "epoch", 0))
        used = 0 if used_up else self._yielded
        done = used_up or used * (source.batch_size or 1) >= len(sampler)  # type: ignore[arg-type]
        consumed = self._base + self.world_size * used * (source.batch_size or 1)
        return {
            "order": asdict(order),
            "epoch": epoch,
            "base": 0 if used_up else self._base,
            "yielded": used,
            "consumed": order.dataset_len if done else min(consumed, order.dataset_len),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at this rank's saved position, or at its share of every rank's."""
        value = state["position"].value
        if "resharded" not in value and int(value["world_size"]) != self.world_size:
            raise CheckpointMismatchError(
                f"the data loader's position was saved on {value['world_size']} data-parallel "
                f"ranks and loads on {self.world_size} in a job of as many processes (another "
                "tensor-parallel degree, say): each process holds only its own position. Load "
                f"with {value['world_size']} data-parallel ranks, or leave the data loader out."
            )
        self._rest, self._continues = None, True
        if value.get("resharded") == "iterable":
            self._base, self._yielded = 0, 0
            self.loader.load_state_dict(value["loader"])
        elif value.get("resharded") == "map" or self._resumes_by_position(value):
            self._resume_at(int(value["epoch"]), int(value["consumed"]))
        else:  # torchdata's own state: the next batches are the uninterrupted run's
            if value["order"] is not None:
                _set_epoch(self.loader.sampler, int(value["epoch"]), 0)
                self._base, self._yielded = int(value["base"]), int(value["yielded"])
                self._epoch = int(value["epoch"])
                self._continues = value["consumed"] < value["order"]["dataset_len"]
            self.loader.load_state_dict(_untagged(value["loader"]))

    def _resumes_by_position(self, value: dict[str, Any]) -> bool:
        """Whether a pass resumes from the job's position rather than torchdata's state: the
        rest of an epoch after a resize, or a ReshardableSampler (whose state is the job's, and
        which torchdata would restart at its pass's start)."""
        if value["order"] is None:
            return False
        return bool(value["in_rest"]) or isinstance(self.loader.sampler, ReshardableSampler)

    def _resume_at(self, epoch: int, consumed: int) -> None:
        """Go on with epoch ``epoch`` after its first ``consumed`` positions, on this world."""
        order = _epoch_order(self.loader.sampler)
        if order is None:
            raise CheckpointMismatchError(
                f"the data loader's position is {consumed} samples into epoch {epoch} of a "
                f"map-style order, but this loader's sampler is a "
                f"{type(self.loader.sampler).__name__}; expected a DistributedSampler or a "
                "unickpt.data.ReshardableSampler, as in the saved run."
            )
        _set_epoch(self.loader.sampler, epoch, consumed)
        self.loader.load_state_dict({})  # drop an iterator made before the load (by state_dict)
        self._base, self._yielded, self._epoch = consumed, 0, epoch
        if consumed >= order.dataset_len:  # the epoch is over: the next pass is the next one
            self._continues = False
        elif not isinstance(self.loader.sampler, ReshardableSampler):
            self._rest = self._loader_for_rest(order, epoch, consumed)

    def _loader_for_rest(self, order: EpochOrder, epoch: int, consumed: int) -> StatefulDataLoader:
        """A loader built like the user's over what is left of an epoch, split on this world."""
        from torchdata.stateful_dataloader import StatefulDataLoader

        sampler = ReshardableSampler(
            order.dataset_len,
            shuffle=order.shuffle,
            seed=order.seed,
            drop_last=order.drop_last,
            rank=self.rank,
            world_size=self.world_size,
        )
        sampler.set_epoch(epoch)
        sampler.consumed = consumed
        args = {name: getattr(self.loader, name) for name in _LOADER_ARGS}
        if args["num_workers"] == 0:
            args.pop("prefetch_factor")
            args["persistent_workers"] = False
        return StatefulDataLoader(self.loader.dataset, sampler=sampler, **args)

    # -- resharding -----------------------------------------------------------------------------

    def reshard(self, saved: list[dict[str, Any]], world_size: int, rank: int) -> dict[str, Any]:
        """This rank's position from every saving rank's, on ``world_size`` ranks (the PerRank
        function the load calls when the number of processes changed)."""
        positions = _by_data_parallel_rank(saved)
        if positions[0]["order"] is not None:
            return _reshard_map(positions)
        return self._reshard_iterable(positions, world_size, rank)

    def _reshard_iterable(
        self, saved: list[dict[str, Any]], world_size: int, rank: int
    ) -> dict[str, Any]:
        if self.loader.num_workers or any(s["loader"].get("_snapshot") for s in saved):
            raise CheckpointMismatchError(
                f"the data loader's iterable dataset was read with workers, each holding its own "
                f"position; unickpt reshards it only without workers (num_workers=0). Load on "
                f"{len(saved)} ranks, or leave the data loader out of the load (the stream "
                "starts over)."
            )
        fresh = self.loader.state_dict()
        template = fresh.get("dataset_state")
        states = [s["loader"].get("dataset_state") for s in saved]
        fresh["dataset_state"] = _reshard_dataset_state(template, states, world_size, rank)
        return {"resharded": "iterable", "loader": fresh}


def _by_data_parallel_rank(saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One position per saving data-parallel rank, in rank order (the processes of one
    data-parallel rank, tensor-parallel ones say, saved the same); all of them, or refused."""
    by_rank: dict[int, dict[str, Any]] = {}
    for value in saved:
        by_rank.setdefault(int(value["rank"]), value)
    degree = int(saved[0]["world_size"])
    if sorted(by_rank) != list(range(degree)):
        raise CheckpointMismatchError(
            f"the data loader's position was saved by data-parallel ranks {sorted(by_rank)} of "
            f"{degree}; resharding needs every one's. Load on {degree} data-parallel ranks, or "
            "leave the data loader out of the load."
        )
    return [by_rank[r] for r in range(degree)]


def _reshard_map(saved: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's share of the rest of the epoch: the same order, epoch and consumed count
    on every saving rank, or the ranks were not at one step of one epoch."""
    keys = ("order", "epoch", "consumed")
    seen = {tuple(repr(s.get(k)) for k in keys) for s in saved}
    if len(seen) > 1:
        found = "; ".join(
            f"rank {i}: epoch {s.get('epoch')}, {s.get('consumed')} consumed"
            for i, s in enumerate(saved)
        )
        raise CheckpointMismatchError(
            f"the data loader's saving ranks were not at one position of one epoch order "
            f"({found}); expected every data-parallel rank to have read as many batches. Save "
            "between steps, where every rank has stepped alike."
        )
    first = saved[0]
    log.info(
        "data loader resharded from %d ranks at epoch %s, %s samples consumed",
        len(saved),
        first["epoch"],
        first["consumed"],
    )
    return {"resharded": "map", **{k: first[k] for k in keys}}


def _reshard_dataset_state(
    template: Any, states: list[Any], world_size: int, rank: int
) -> dict[str, Any]:
    """An iterable dataset's state for this rank: each PerRank entry of the dataset's own
    (fresh) state through its function, the others kept where every rank saved the same."""
    if not isinstance(template, dict) or not any(
        isinstance(v, PerRank) and callable(v.on_world_change) for v in template.values()
    ):
        raise CheckpointMismatchError(
            f"the data loader reads an iterable dataset whose position is per rank and has no "
            f"resharding function (its state_dict holds no PerRank(..., on_world_change=fn)), "
            f"saved on {len(states)} ranks; unickpt cannot split it exactly. Load on "
            f"{len(states)} ranks; or give the dataset a state that reshards (such as "
            "unickpt.data.ShardedStream's); or leave the data loader out of the load."
        )
    out: dict[str, Any] = {}
    for key, fresh in template.items():
        values = [_untagged(s[key]) for s in states]
        if isinstance(fresh, PerRank) and callable(fresh.on_world_change):
            plain = [v.value if isinstance(v, PerRank) else v for v in values]
            out[key] = PerRank(fresh.on_world_change(plain, world_size, rank))
        elif all(repr(v) == repr(values[0]) for v in values):
            out[key] = values[0]
        else:
            raise CheckpointMismatchError(
                f"the data loader's dataset state '{key}' differs between the saving ranks "
                "and is no PerRank value with a resharding function; unickpt cannot tell "
                f"which rank's to keep. Load on {len(states)} ranks, or make '{key}' a "
                "PerRank(..., on_world_change=fn) value."
            )
    return out


# -- samplers --------------------------------------------------------------------------------


def _epoch_order(sampler: Any) -> EpochOrder | None:
    """The order a distributed sampler splits, or None for a sampler unickpt cannot split."""
    if isinstance(sampler, ReshardableSampler):
        return EpochOrder(sampler.dataset_len, sampler.shuffle, sampler.seed, sampler.drop_last)
    if isinstance(sampler, DistributedSampler):
        n = len(sampler.dataset)  # type: ignore[arg-type]
        return EpochOrder(n, sampler.shuffle, sampler.seed, sampler.drop_last)
    return None


def _set_epoch(sampler: Any, epoch: int, consumed: int) -> None:
    """Put a sampler at the saved epoch (and a ReshardableSampler at its pass's start)."""
    if isinstance(sampler, ReshardableSampler):
        sampler.set_epoch(epoch)
        sampler.consumed = consumed
    elif isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)


# -- PerRank values inside a loader's state ----------------------------------------------------


def _tagged(state: Any) -> Any:
    """``state`` with each PerRank value replaced by a tagged dict (a PerRank inside a PerRank
    value is not stored as such)."""
    if isinstance(state, PerRank):
        return {_PER_RANK_TAG: _tagged(state.value)}
    if isinstance(state, dict):
        return {k: _tagged(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_tagged(v) for v in state]
    return state


def _untagged(state: Any) -> Any:
    """The inverse of :func:`_tagged`: the tagged dicts as PerRank values again."""
    if isinstance(state, dict):
        if set(state) == {_PER_RANK_TAG}:
            return PerRank(_untagged(state[_PER_RANK_TAG]))
        return {k: _untagged(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_untagged(v) for v in state]
    return state


__all__ = ["EpochOrder", "ReshardableLoader", "reshardable"]
