"""A distributed sampler whose position is the whole job's: it resumes on any number of ranks.

Each epoch has one order of the dataset's indices (a permutation seeded by ``seed + epoch``, or
``0..n-1``). The state is global: the epoch, the seed and ``consumed``, how many samples of that
order the whole job has used. Ranks take the samples not yet consumed in turn (rank ``r`` takes
positions ``r, r + world_size, ...`` of what is left), so after ``k`` steps of ``b`` samples on
every rank the job has used exactly the first ``k * b * world_size`` samples of the order,
whatever the world size was when the epoch started. A load on another world size splits the rest
of the order over the new ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..errors import CheckpointError, CheckpointMismatchError

log = logging.getLogger(__name__)


class ReshardableSampler(Sampler[int]):
    """Indices of a map-style dataset for this rank, resumable on any world size.

    The job says how much it consumed: call :meth:`advance` with the samples each rank used in a
    step (every rank with the same number, as data-parallel ranks do), or set :attr:`consumed` to
    the job's global count (steps times the global batch). The sampler never counts what it
    yields: a DataLoader fetches ahead of what training used (workers, prefetching), and a count
    of fetched samples would skip those on resume. Its :meth:`state_dict` is the same on every
    rank: put the sampler in the state as a replicated value.

    ``drop_last=False`` pads the last step of an epoch with samples from the start of what was
    left, so every rank gets as many (as ``torch.utils.data.DistributedSampler`` does);
    ``drop_last=True`` leaves out the last ``< world_size`` samples instead.

    >>> from unickpt.data import ReshardableSampler
    >>> sampler = ReshardableSampler(10, shuffle=False, rank=1, world_size=2)
    >>> list(sampler)
    [1, 3, 5, 7, 9]
    >>> sampler.advance(2)  # each of the 2 ranks used 2 samples: 4 in all
    >>> sampler.state_dict()["consumed"]
    4
    >>> resumed = ReshardableSampler(10, shuffle=False, rank=0, world_size=3)
    >>> resumed.load_state_dict(sampler.state_dict())
    >>> list(resumed)  # of 4..9 left: ranks 0, 1, 2 take 4 7, 5 8, 6 9
    [4, 7]
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.dataset_len = int(dataset_len)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.rank, self.world_size = _rank_and_size(rank, world_size)
        self.epoch = 0
        self.consumed = 0
        if self.dataset_len < 0:
            raise CheckpointError(
                f"ReshardableSampler: dataset_len is {dataset_len}; pass len(dataset) (>= 0)."
            )

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (its own order, nothing of it consumed); the current epoch again
        (as a loop resumed mid-epoch calls it) keeps the position."""
        if int(epoch) != self.epoch:
            self.epoch, self.consumed = int(epoch), 0

    def advance(self, samples_per_rank: int) -> None:
        """Count a step in which every rank used ``samples_per_rank`` samples (the padding of
        an epoch's last step counts up to the epoch's end)."""
        self.consumed = min(self.dataset_len, self.consumed + samples_per_rank * self.world_size)

    def order(self) -> torch.Tensor:
        """The epoch's order of every index."""
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=g)

    def __len__(self) -> int:
        """The samples this rank yields for the rest of the epoch."""
        rest = max(0, self.dataset_len - self.consumed)
        if self.drop_last:
            return rest // self.world_size
        return -(-rest // self.world_size)

    def __iter__(self) -> Iterator[int]:
        rest = self.order()[self.consumed :]
        count = len(self)
        short = count * self.world_size - len(rest)
        if short > 0:  # pad from the start of what is left, wrapping round if need be
            rest = torch.cat([rest, rest.repeat(1 + short // len(rest))[:short]])
        return iter(rest[self.rank :: self.world_size][:count].tolist())

    def state_dict(self) -> dict[str, Any]:
        """The job's position (the same on every rank)."""
        return {
            "dataset_len": self.dataset_len,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": self.consumed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position, on this sampler's rank and world size."""
        for name in ("dataset_len", "shuffle"):
            if state[name] != getattr(self, name):
                raise CheckpointMismatchError(
                    f"ReshardableSampler: the checkpoint's sampler has {name}={state[name]!r} "
                    f"but this one {name}={getattr(self, name)!r}; the saved position means "
                    f"nothing in another order. Build the sampler with {name}={state[name]!r}."
                )
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        self.consumed = int(state["consumed"])
        log.debug("sampler resumed at epoch %d, %d consumed", self.epoch, self.consumed)


def _rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The given rank and world size, or torch.distributed's (0 and 1 without a group)."""
    joined = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if joined else 0
    if world_size is None:
        world_size = dist.get_world_size() if joined else 1
    if world_size < 1 or not 0 <= rank < world_size:
        raise CheckpointError(
            f"rank {rank} of world_size {world_size}: expected 0 <= rank < world_size; pass the "
            "data-parallel rank and size (or leave both out to use torch.distributed's)."
        )
    return rank, world_size
