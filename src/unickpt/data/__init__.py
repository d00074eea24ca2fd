"""Data loading that resumes exactly on any number of data-parallel ranks.

- :class:`ReshardableSampler`: a map-style sampler for ``torch.utils.data.DataLoader(sampler=)``
  whose state (epoch, seed, samples the whole job consumed) is the same on every rank, saved as
  a replicated value; a resumed job on any world size splits the rest of the epoch anew.
- :class:`ShardedStream`: token files read in fixed-length samples, sharded by file over ranks;
  its per-rank state (a cursor per file and the carried tokens) is a :class:`unickpt.PerRank`
  value that :func:`redistribute` spreads over the ranks of a resumed job of another size.

- :func:`reshardable`: torchdata's ``StatefulDataLoader`` (over a ``DistributedSampler``, a
  :class:`ReshardableSampler` or an iterable dataset whose state reshards) made resumable on any
  world size: exactly where it stopped at the saved one, the rest of the epoch split anew at
  another.

See docs/data.md.
"""

from .loader import ReshardableLoader, reshardable
from .sampler import ReshardableSampler
from .stream import Cursor, ShardedStream, redistribute

__all__ = [
    "Cursor",
    "ReshardableLoader",
    "ReshardableSampler",
    "ShardedStream",
    "redistribute",
    "reshardable",
]
