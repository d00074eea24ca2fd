"""A PerRank value resharded by its own function when the world size changed since the save.

Every rank's saved value of a per-rank key lies in the checkpoint's metadata, which every
loading rank reads already: resharding reads nothing more. The saved values are decoded only
where the function is called, that is when the world size changed or some saving rank held no
value under the key; otherwise each rank gets its own value back as for any PerRank value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from ..format.metadata import Metadata
from ..format.values import decode_value
from ..layouts.leaves import Reshard


@dataclass(frozen=True)
class Resharded:
    """The value a rank gets from a resharding function, and the saving ranks that held none
    (``missing``) for the load to warn about."""

    value: Any
    missing: tuple[int, ...]


def holders(meta: Metadata, key: str) -> list[int]:
    """The saving ranks that held a value under per-rank ``key``, in rank order."""
    return [r for r in range(meta.world_size) if meta.per_rank_value(key, r)[0]]


def needs_reshard(meta: Metadata, key: str, world_size: int) -> bool:
    """Whether a load on ``world_size`` ranks calls the key's function (the same on every
    rank: it depends on the metadata and the world size only)."""
    return meta.world_size != world_size or len(holders(meta, key)) != meta.world_size


def reshard(
    meta: Metadata,
    key: str,
    fn: Reshard,
    world_size: int,
    rank: int,
    allow_pickle: bool,
) -> Resharded:
    """``fn(saved values, world_size, rank)``; an error of ``fn`` is raised as a
    :class:`CheckpointError` naming the key."""
    held = holders(meta, key)
    saved = [decode_value(meta.per_rank_value(key, r)[1], key, allow_pickle) for r in held]
    try:
        value = fn(saved, world_size, rank)
    except Exception as e:
        name = getattr(fn, "__qualname__", repr(fn))
        raise CheckpointError(
            f"'{key}': its PerRank on_world_change function {name} failed on rank {rank} of "
            f"{world_size} with the values of {len(held)} of {meta.world_size} saving ranks: "
            f"{type(e).__name__}: {e}. Fix the function, or load on the saved world size."
        ) from e
    missing = tuple(r for r in range(meta.world_size) if r not in set(held))
    return Resharded(value, missing)


def missing_warning(meta: Metadata, key: str, missing: tuple[int, ...], world_size: int) -> str:
    """The warning of a resharded key some saving ranks held no value under."""
    ranks = ", ".join(str(r) for r in missing)
    return (
        f"'{key}': saving rank{'s' if len(missing) > 1 else ''} {ranks} of {meta.world_size} "
        f"held no value; its PerRank function resharded the values of the others over "
        f"{world_size} loading ranks."
    )
