"""Where a DTensor's local shard lies in its global tensor.

For ``Shard`` and ``Replicate`` placements a local shard is one box, computed by DTensor's own
``compute_local_shape_and_global_offset``. A ``_StridedShard`` (FSDP2 over tensor parallelism)
may give a rank rows that are not contiguous in the global tensor; there the global index of
every local row is worked out per dimension, by DTensor's own splitting rules applied to the
indices, and each run of consecutive indices becomes a box.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ..dist import on_reset
from ..errors import CheckpointError
from .boxes import Box

try:
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Shard
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - torch without strided shards
    _StridedShard = None  # type: ignore[assignment,misc]

# One run of consecutive global indices along a dimension: (global start, local start, length).
Run = tuple[int, int, int]
# Per dimension, the runs of this rank's local shard.
Layout = tuple[tuple[Run, ...], ...]


def is_dtensor(value: Any) -> bool:
    return DTensor is not None and isinstance(value, DTensor)


# (global shape, mesh, placements) -> the runs of this rank's shard, or None where this rank
# is outside the mesh. DTensor's own computation costs ~50 us a tensor, which a state of
# thousands of tensors would pay on every save; layouts repeat from one save to the next.
_LAYOUTS: dict[tuple[Any, ...], Layout | None] = {}
on_reset(_LAYOUTS.clear)  # its meshes hold the process groups of a membership that ended
_LAYOUTS_MAX = 1 << 16


def _layout(dt: Any) -> Layout | None:
    key = (tuple(dt.shape), dt.device_mesh, tuple(dt.placements))
    try:
        return _LAYOUTS[key]
    except KeyError:
        pass
    found: Layout | None = None
    if dt.device_mesh.get_coordinate() is not None:
        if _StridedShard is not None and any(isinstance(p, _StridedShard) for p in dt.placements):
            found = _strided_layout(dt)
        else:
            shape, offsets = compute_local_shape_and_global_offset(
                dt.shape, dt.device_mesh, dt.placements
            )
            found = tuple(((int(o), 0, int(n)),) for o, n in zip(offsets, shape))
    if len(_LAYOUTS) >= _LAYOUTS_MAX:
        _LAYOUTS.clear()
    _LAYOUTS[key] = found
    return found


def _strided_layout(dt: Any) -> Layout:
    """Runs per dimension from the global index of every local position along it."""
    mesh = dt.device_mesh
    coordinate = mesh.get_coordinate()
    indices = [torch.arange(int(n)) for n in dt.shape]
    for mesh_dim, placement in enumerate(dt.placements):
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        d = placement.dim
        split = _one_dim(placement)
        parts, _ = split._split_tensor(
            indices[d], mesh.size(mesh_dim), with_padding=False, contiguous=False
        )
        indices[d] = parts[coordinate[mesh_dim]].reshape(-1)
    return tuple(_runs(ix.tolist()) for ix in indices)


def _one_dim(placement: Any) -> Any:
    """The same placement acting on dimension 0 of a 1-d tensor of indices."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor)
    return Shard(0)


def _runs(indices: list[int]) -> tuple[Run, ...]:
    runs: list[Run] = []
    for local, g in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][2] == g:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((g, local, 1))
    return tuple(runs)


def dtensor_pieces(key: str, dt: Any, local: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """The boxes of the global tensor that this rank's local shard of ``dt`` holds, each with
    the view of ``local`` holding it. Empty when this rank holds no element.
    """
    if any(isinstance(p, Partial) for p in dt.placements):
        raise CheckpointError(
            f"'{key}' is a DTensor with a Partial placement {dt.placements}; a checkpoint holds "
            "final values. Call .redistribute() to Replicate() or Shard() before saving."
        )
    layout = _layout(dt)
    if layout is None:
        return []
    shape = tuple(sum(n for _, _, n in runs) for runs in layout)
    if tuple(local.shape) != shape:
        raise CheckpointError(
            f"'{key}': the DTensor's local shard has shape {tuple(local.shape)} but its placements "
            f"{dt.placements} on mesh {tuple(dt.device_mesh.shape)} give {shape}; unickpt "
            "supports shards laid out as DTensor's own rules say (no custom padding)."
        )
    if any(n == 0 for n in shape):
        return []
    if all(len(runs) == 1 for runs in layout):
        return [(Box(tuple(r[0][0] for r in layout), shape), local)]
    pieces = []
    for combo in itertools.product(*layout):
        box = Box(tuple(g for g, _, _ in combo), tuple(n for _, _, n in combo))
        view = local[tuple(slice(first, first + n) for _, first, n in combo)]
        pieces.append((box, view))
    return pieces


def local_tensor(dt: Any) -> torch.Tensor:
    """The local shard, without going through autograd as ``to_local()`` does (a checkpoint
    reads and fills values only)."""
    local = getattr(dt, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else dt.to_local()
