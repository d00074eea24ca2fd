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


def dtensor_box(key: str, dt: Any) -> Box | None:
    """The box of the global tensor that this rank's local shard of ``dt`` holds.

    None when this rank holds no part of it (not in the mesh, or an empty uneven last shard).
    """
    if any(isinstance(p, Partial) for p in dt.placements):
        raise CheckpointError(
            f"'{key}' is a DTensor with a Partial placement {dt.placements}; a checkpoint holds "
            "final values. Call .redistribute() to Replicate() or Shard() before saving."
        )
    if dt.device_mesh.get_coordinate() is None:
        return None
    shape, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    local = dt.to_local()
    if tuple(local.shape) != tuple(shape):
        raise CheckpointError(
            f"'{key}': the DTensor's local shard has shape {tuple(local.shape)} but its placements "
            f"{dt.placements} on mesh {tuple(dt.device_mesh.shape)} give {tuple(shape)}; unickpt "
            "supports shards laid out as DTensor's own rules say (no custom padding)."
        )
    box = Box(tuple(int(o) for o in offsets), tuple(int(s) for s in shape))
    return box if box.numel > 0 else None


def local_tensor(dt: Any) -> torch.Tensor:
    return dt.to_local()
