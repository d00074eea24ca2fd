"""Megatron-Core: its sharded state dicts saved and loaded by unickpt, resharding on TP/PP/EP.

The one-call switch from ``dist_checkpointing.save/load``::

    from unickpt.integrations import megatron as um

    um.save(model.sharded_state_dict(), path)              # every rank
    state = um.load(model.sharded_state_dict(), path)      # every rank; tensors filled in place
    model.load_state_dict(state)                           # optional: the tensors are the params

What maps to what:

- a ``ShardedTensor`` is a :class:`unickpt.ShardedTensor` block of the global tensor named by its
  key. Axes prepended by Megatron (``prepend_axis_num``: the layer of a stacked layer, the
  expert) are folded into the key, ``{key}.{layer}`` and ``{key}.{layer}.{expert}`` with the
  expert's global index (SequentialMLP's experts), so each layer and expert is a tensor of its
  own and a pipeline stage or expert-parallel rank holding others loads it. ``replica_id`` is
  not needed: blocks held alike by several ranks (data-parallel replicas, an expert's replicas
  over its expert-data-parallel group) are written once and loaded by all;
- a ``ShardedTensorFactory`` (SwiGLU's ``linear_fc1``) is built into its ShardedTensors; blocks
  of one key held in one local tensor (the gate and up rows) become one :class:`unickpt.Fused`
  leaf whose pieces are boxes of that key, loaded in place; the factory's ``merge_fn`` then gives
  its data;
- blocks of one key in separate tensors on a rank are joined: consecutive blocks of a 1-D
  tensor into one :class:`unickpt.FlatShard` (the DistributedOptimizer's ``dp_reshardable``
  buckets: one flat range per data-parallel rank), others along dimension 0 into a ``Fused``
  buffer; a joined buffer is copied back after a load;
- the DistributedOptimizer's ``dp_reshardable`` (reshards over data parallelism) and
  ``fully_reshardable`` (any TP/PP/DP) sharding types are saved as they come;
  ``dp_zero_gather_scatter`` and ``flattened_range`` tensors (``fully_sharded_model_space``) are
  refused, naming those two;
- a ``ShardedObject`` is a value under ``{key}`` plus ``.shard_{offsets}`` when its global shape
  holds several shards; tensors inside it are saved as replicated tensors of that key;
- any other entry (a plain value or tensor of the common state) is saved under
  ``common.{path}`` (written once, by the lowest rank holding it, as Megatron's common state is)
  and returned as loaded; a ``LocalNonpersistentObject`` is not saved and returned unwrapped.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import api
from ..config import get_config
from ..dist import Comm, on_every_rank
from ..engine.commit import read_metadata
from ..errors import CheckpointError
from ..format.dtypes import dtype_from_name
from ..layouts.leaves import FlatShard, Fused, FusedPiece, ShardedTensor
from ..storage.registry import open_storage

log = logging.getLogger(__name__)

COMMON = "common"

SHARDING_TYPE = "param_state_sharding_type"
"""The entry of a DistributedOptimizer's sharded state dict that names its sharding type."""

WORKING_TYPES = (
    "'dp_reshardable' (each data-parallel rank writes its own flat ranges of the buckets; loads "
    "at another data-parallel size) or 'fully_reshardable' (the state in the parameters' shapes, "
    "gathered over data parallelism by Megatron; loads at any TP/PP/DP)"
)

REFUSED_TYPES = {
    "dp_zero_gather_scatter": "gathers the whole optimizer state into one object on "
    "data-parallel rank 0 (deprecated in megatron-core), which cannot reshard",
    "fully_sharded_model_space": "holds ShardedTensors with flattened ranges, which "
    "megatron-core 0.16 refuses itself",
}
"""DistributedOptimizer sharding types refused, and why."""


@dataclass(frozen=True)
class _Block:
    """One Megatron ShardedTensor without its prepended axes: a box of the tensor ``key``."""

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass
class _Mapped:
    """A sharded state dict as a unickpt state, and how to put a load back into it."""

    state: dict[str, Any] = field(default_factory=dict)
    blocks: dict[str, list[_Block]] = field(default_factory=dict)
    copies: list[Callable[[], None]] = field(default_factory=list)  # buffers back to blocks
    merges: list[Callable[[], None]] = field(default_factory=list)  # then factories' merge_fn


def save(sharded_state_dict: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> None:
    """Save a Megatron-Core sharded state dict; every rank calls it with its own.

    ``kwargs`` go to :func:`unickpt.save` (``overwrite=True``, ``group=``, ``compress=``...).

    >>> from unickpt.integrations import megatron as um
    >>> um.save(model.sharded_state_dict(), "/ckpt/step-100")  # doctest: +SKIP
    """
    what = "mapping the Megatron sharded state dict"
    mapped = on_every_rank(_comm(kwargs), what, lambda: _map(sharded_state_dict))
    api.save(path, mapped.state, **kwargs)


def load(sharded_state_dict: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """Load into a Megatron-Core sharded state dict at any TP/PP/EP layout; every rank calls it.

    The tensors of ``sharded_state_dict`` are filled in place. Returns it as Megatron's
    ``dist_checkpointing.load`` does: each ShardedTensor replaced by its tensor, each factory by
    its merged tensor, each ShardedObject by its loaded value. ``kwargs`` go to
    :func:`unickpt.load` (``strict=``, ``group=``...).

    >>> from unickpt.integrations import megatron as um
    >>> state = um.load(model.sharded_state_dict(), "/ckpt/step-100")  # doctest: +SKIP
    >>> model.load_state_dict(state)  # doctest: +SKIP
    """

    def prepare() -> tuple[_Mapped, dict[str, Any]]:
        mapped = _map(sharded_state_dict)
        return mapped, _saved_common(path, mapped.state)

    # Each rank maps its entries and reads the checkpoint's common keys alone: a failure on one
    # rank is raised on every rank here, before the load's collectives.
    mapped, extra = on_every_rank(_comm(kwargs), "preparing the Megatron load", prepare)
    mapped.state.update(extra)
    api.load(path, mapped.state, **kwargs)  # values are put back into mapped.state
    for finish in [*mapped.copies, *mapped.merges]:
        finish()
    loaded = _loaded(sharded_state_dict, mapped.state, "")
    for key in extra:
        _put_missing(loaded, key[len(COMMON) + 1 :].split("."), mapped.state[key])
    return loaded


def _comm(kwargs: dict[str, Any]) -> Comm:
    """The ranks of the save or load that ``kwargs`` (``group=``, ``config=``) describe."""
    config = kwargs.get("config") or get_config()
    return Comm(kwargs.get("group"), config.collective_timeout_s)


def _saved_common(path: str | os.PathLike[str], state: dict[str, Any]) -> dict[str, Any]:
    """Slots for the common entries saved but absent from a loading state dict (Megatron's
    optimizer asks for ``common_step`` only when saving): returned too, as Megatron's own load
    returns its whole common state."""
    _, meta = read_metadata(open_storage(path))
    prefix = f"{COMMON}."
    slots: dict[str, Any] = {}
    for key, t in meta.tensors.items():
        if key.startswith(prefix) and key not in state:
            slots[key] = torch.empty(t.value_shape, dtype=dtype_from_name(t.value_dtype))
    for key in meta.objects:
        if key.startswith(prefix) and key not in state:
            slots[key] = None
    return slots


def _put_missing(node: dict[str, Any], path: list[str], value: Any) -> None:
    """``value`` at ``path`` unless the loading dict holds something there: a saved common
    value never replaces what was loaded (the ``None`` that data-parallel ranks > 0 hold in
    place of a ``fully_reshardable`` optimizer's gathered state)."""
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            return
        node = child
    node.setdefault(path[-1], value)


def _mapping() -> Any:
    try:
        from megatron.core.dist_checkpointing import mapping
    except ImportError as e:  # pragma: no cover - the integration needs megatron-core
        raise CheckpointError(
            f"unickpt.integrations.megatron needs megatron-core ({e}); pip install megatron-core."
        ) from None
    return mapping


def _map(sharded_state_dict: dict[str, Any]) -> _Mapped:
    mapped = _Mapped()
    for path, value in _walk(sharded_state_dict, ""):
        _map_entry(mapped, path, value)
    for key, blocks in mapped.blocks.items():
        mapped.state[key] = _leaf(key, blocks, mapped.copies)
    return mapped


def _walk(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """The leaves of nested dicts and lists, with their dotted paths."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        path = f"{prefix}{k}"
        if isinstance(v, (dict, list)) and v:
            yield from _walk(v, path + ".")
        else:
            yield path, v


def _map_entry(mapped: _Mapped, path: str, value: Any) -> None:
    m = _mapping()
    if isinstance(value, m.ShardedTensorFactory):
        _map_factory(mapped, value)
    elif isinstance(value, m.ShardedTensor):
        block = _block(value)
        mapped.blocks.setdefault(block.key, []).append(block)
    elif isinstance(value, m.ShardedObject):
        mapped.state[_object_key(value)] = value.data
    elif not isinstance(value, m.LocalNonpersistentObject):
        _check_sharding_type(path, value)
        mapped.state[f"{COMMON}.{path}"] = value


def _check_sharding_type(path: str, value: Any) -> None:
    """Refuse a DistributedOptimizer state of a sharding type unickpt does not reshard."""
    if path.rsplit(".", 1)[-1] != SHARDING_TYPE or not isinstance(value, str):
        return
    if value not in REFUSED_TYPES:
        return
    raise CheckpointError(
        f"'{path}' is '{value}': this sharding type {REFUSED_TYPES[value]}. Build the "
        "optimizer's sharded state dict with metadata={'distrib_optim_sharding_type': ...} "
        f"set to {WORKING_TYPES}, at save and at load."
    )


def _map_factory(mapped: _Mapped, factory: Any) -> None:
    """Build the factory into its ShardedTensors; after a load, merge them into its data."""
    m = _mapping()
    built = factory.build()
    subs = [v for _, v in _walk(built, "")] if isinstance(built, (dict, list)) else [built]
    for sub in subs:
        if not isinstance(sub, m.ShardedTensor):
            raise CheckpointError(
                f"The ShardedTensorFactory '{factory.key}' built a {type(sub).__name__}; "
                "expected ShardedTensors only. Apply its factories before saving."
            )
        block = _block(sub)
        mapped.blocks.setdefault(block.key, []).append(block)

    def merge() -> None:
        merged = factory.merge_fn(_replace_sharded(built))
        if merged.data_ptr() != factory.data.data_ptr():
            with torch.no_grad():
                factory.data.copy_(merged)

    mapped.merges.append(merge)


def _replace_sharded(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _replace_sharded(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_replace_sharded(v) for v in node]
    return node.data if isinstance(node, _mapping().ShardedTensor) else node


def _block(sh: Any) -> _Block:
    """A ShardedTensor as a box of a tensor whose key holds its prepended offsets."""
    if sh.flattened_range is not None:
        raise CheckpointError(
            f"ShardedTensor '{sh.key}' has a flattened_range (the DistributedOptimizer's "
            "'fully_sharded_model_space' layout), which megatron-core 0.16 refuses too. Build "
            "the optimizer's sharded state dict with "
            f"metadata={{'distrib_optim_sharding_type': ...}} set to {WORKING_TYPES}."
        )
    p = int(sh.prepend_axis_num)
    lead = tuple(int(o) for o in sh.global_offset[:p])
    key = ".".join([sh.key, *map(str, lead)])
    data = sh.data
    if tuple(data.shape) != tuple(sh.local_shape):
        raise CheckpointError(
            f"ShardedTensor '{sh.key}': its data has shape {tuple(data.shape)} but its "
            f"local_shape is {tuple(sh.local_shape)}; they must agree."
        )
    shape = tuple(int(s) for s in sh.global_shape[p:])
    offsets = tuple(int(o) for o in sh.global_offset[p:])
    return _Block(key, data, shape, offsets)


def _object_key(obj: Any) -> str:
    if math.prod(obj.global_shape) <= 1:
        return str(obj.key)
    return f"{obj.key}.shard_{'_'.join(str(int(o)) for o in obj.global_offset)}"


def _leaf(key: str, blocks: list[_Block], after_load: list[Callable[[], None]]) -> Any:
    """One unickpt leaf for the blocks of one tensor this rank holds."""
    if len(blocks) == 1:
        b = blocks[0]
        return ShardedTensor(b.data, b.global_shape, b.offsets)
    run = _flat_run(blocks)
    if run is not None:
        return _flat(run, after_load)
    view = _joined_view(blocks)
    if view is not None:
        base, dim = view
        return Fused(base, dim, _pieces(blocks, dim))
    return _copied(key, blocks, after_load)


def _flat_run(blocks: list[_Block]) -> list[_Block] | None:
    """The blocks of a 1-D tensor in order, when each begins where the one before ends: one
    flat range (a DistributedOptimizer bucket's range on a data-parallel rank, its parameters'
    states and the padding between them as blocks of their own)."""
    if len(blocks[0].global_shape) != 1:
        return None
    run = sorted(blocks, key=lambda b: b.offsets[0])
    for before, after in itertools.pairwise(run):
        if before.offsets[0] + before.data.numel() != after.offsets[0]:
            return None
    return run


def _flat(run: list[_Block], after_load: list[Callable[[], None]]) -> FlatShard:
    """One flat range over consecutive blocks: a view when they lie in one tensor, else a
    buffer joining them, copied back after a load."""
    first = run[0]
    view = _joined_view(run)
    if view is not None:
        return FlatShard(view[0], first.global_shape, first.offsets[0])
    buffer = torch.cat([b.data.detach().reshape(-1) for b in run])
    after_load.append(lambda: _copy_back(run, buffer))
    return FlatShard(buffer, first.global_shape, first.offsets[0])


def _copy_back(blocks: list[_Block], buffer: torch.Tensor) -> None:
    """Each block's rows of ``buffer`` (joined along dimension 0) back into its tensor."""
    start = 0
    for b in blocks:
        n = b.data.shape[0]
        with torch.no_grad():
            b.data.copy_(buffer[start : start + n].view(b.data.shape))
        start += n


def _joined_view(blocks: list[_Block]) -> tuple[torch.Tensor, int] | None:
    """A tensor the blocks are consecutive slices of along one dimension, sharing memory."""
    first = blocks[0].data
    if any(b.data.dim() != first.dim() or b.data.stride() != first.stride() for b in blocks):
        return None
    if any(
        b.data.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for b in blocks
    ):
        return None
    for dim in range(first.dim()):
        others = [d for d in range(first.dim()) if d != dim]
        if any(b.data.shape[d] != first.shape[d] for b in blocks for d in others):
            continue
        offset = first.storage_offset()
        for b in blocks:
            if b.data.storage_offset() != offset:
                break
            offset += b.data.shape[dim] * first.stride(dim)
        else:
            shape = list(first.shape)
            shape[dim] = sum(b.data.shape[dim] for b in blocks)
            return first.as_strided(shape, first.stride(), first.storage_offset()), dim
    return None


def _copied(key: str, blocks: list[_Block], after_load: list[Callable[[], None]]) -> Fused:
    """Blocks in memory of their own: joined into a buffer, copied back after a load."""
    first = blocks[0].data
    if any(b.data.shape[1:] != first.shape[1:] for b in blocks) or first.dim() == 0:
        raise CheckpointError(
            f"'{key}': this rank holds {len(blocks)} blocks of shapes "
            f"{[tuple(b.data.shape) for b in blocks]} in separate tensors; unickpt joins such "
            "blocks along dimension 0 and needs their other dimensions to agree."
        )
    buffer = torch.cat([b.data.detach() for b in blocks])
    after_load.append(lambda: _copy_back(blocks, buffer))
    return Fused(buffer, 0, _pieces(blocks, 0))


def _pieces(blocks: list[_Block], dim: int) -> list[FusedPiece]:
    """The blocks as pieces of a Fused leaf, each a box of the leaf's own key (name "")."""
    return [FusedPiece("", b.global_shape, b.offsets, int(b.data.shape[dim])) for b in blocks]


def _loaded(node: Any, state: dict[str, Any], prefix: str) -> Any:
    """The sharded state dict with its entries replaced by what was loaded."""
    m = _mapping()
    if isinstance(node, dict) and node:
        return {k: _loaded(v, state, f"{prefix}{k}.") for k, v in node.items()}
    if isinstance(node, list) and node:
        return [_loaded(v, state, f"{prefix}{i}.") for i, v in enumerate(node)]
    if isinstance(node, (m.ShardedTensor, m.ShardedTensorFactory)):
        return node.data
    if isinstance(node, m.ShardedObject):
        node.data = state[_object_key(node)]
        return node.data
    if isinstance(node, m.LocalNonpersistentObject):
        return node.unwrap()
    return state[f"{COMMON}.{prefix[:-1]}"]
