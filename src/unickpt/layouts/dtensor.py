"""Where a DTensor's local shard lies in its global tensor."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError
from .boxes import Box

try:
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(value: Any) -> bool:
    return DTensor is not None and isinstance(value, DTensor)


# (global shape, mesh, placements) -> (local shape, global offsets), or None where this rank
# is outside the mesh. DTensor's own computation costs ~50 us a tensor, which a state of
# thousands of tensors would pay on every save; layouts repeat from one save to the next.
_BOXES: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]] | None] = {}
_BOXES_MAX = 1 << 16


def _local_shape_and_offsets(dt: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    key = (tuple(dt.shape), dt.device_mesh, tuple(dt.placements))
    try:
        return _BOXES[key]
    except KeyError:
        pass
    found: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    if dt.device_mesh.get_coordinate() is not None:
        shape, offsets = compute_local_shape_and_global_offset(
            dt.shape, dt.device_mesh, dt.placements
        )
        found = (tuple(int(s) for s in shape), tuple(int(o) for o in offsets))
    if len(_BOXES) >= _BOXES_MAX:
        _BOXES.clear()
    _BOXES[key] = found
    return found


def dtensor_box(key: str, dt: Any) -> Box | None:
    """The box of the global tensor that this rank's local shard of ``dt`` holds.

    None when this rank holds no part of it (not in the mesh, or an empty uneven last shard).
    """
    if any(isinstance(p, Partial) for p in dt.placements):
        raise CheckpointError(
            f"'{key}' is a DTensor with a Partial placement {dt.placements}; a checkpoint holds "
            "final values. Call .redistribute() to Replicate() or Shard() before saving."
        )
    found = _local_shape_and_offsets(dt)
    if found is None:
        return None
    shape, offsets = found
    local = local_tensor(dt)
    if tuple(local.shape) != shape:
        raise CheckpointError(
            f"'{key}': the DTensor's local shard has shape {tuple(local.shape)} but its placements "
            f"{dt.placements} on mesh {tuple(dt.device_mesh.shape)} give {shape}; unickpt "
            "supports shards laid out as DTensor's own rules say (no custom padding)."
        )
    box = Box(offsets, shape)
    return box if box.numel > 0 else None


def local_tensor(dt: Any) -> torch.Tensor:
    """The local shard, without going through autograd as ``to_local()`` does (a checkpoint
    reads and fills values only)."""
    local = getattr(dt, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else dt.to_local()
