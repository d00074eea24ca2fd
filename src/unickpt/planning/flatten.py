"""Flatten a state into leaves with dotted keys: tensors (as boxes), values, per-rank values.

Dicts are walked, and lists that hold tensors or objects (a list of plain values is one value);
objects with ``state_dict``/``load_state_dict`` are
replaced by their state dict (modules and optimizers keyed by parameter names); tensors,
DTensors, :class:`ShardedTensor` and :class:`FlatShard` become :class:`TensorLeaf` items holding
the boxes this rank has; :class:`PerRank` and every other value become value leaves.

A :class:`Fused` leaf at ``key`` becomes one tensor item per global tensor its pieces name
(``{key}.{name}``; ``key`` itself is no saved key); a :class:`Padded` leaf one item of its
logical shape holding only the logical part of each held box; a :class:`Replicated` leaf a plain
tensor item whose reduction (``reductions``) the save runs across ranks. ``layout`` (see
:mod:`unickpt.layouts.rules`; by default the map of the enclosing ``applying`` block) wraps
the tensors at matching keys into such leaves first.

The same walk serves a load: there each value leaf carries a setter that puts the loaded value
back into its container, and each stateful object a finalizer that gives it its loaded state.

A save's ``keys=`` renames the flattened keys (:func:`rename_for_save`; ``keys=lambda k:
k.removeprefix("model.")`` writes the names ``from_pretrained`` reads) before the plan, the
metadata, ``quantize`` and ``row_deltas`` see them; ``layout=`` patterns name the state's keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..format.values import MAX_DEPTH, too_deep
from ..layouts.boxes import Box, flat_range_to_boxes
from ..layouts.dtensor import dtensor_pieces, is_dtensor, local_tensor
from ..layouts.fused import fused_tensors
from ..layouts.leaves import (
    LAYOUT_LEAVES,
    FlatShard,
    Fused,
    Padded,
    PerRank,
    Replicated,
    ShardedTensor,
)
from ..layouts.padded import clip_pieces
from ..layouts.rules import LayoutMap, Rules, current_rules, rules_of
from .stateful import StatefulAdapter, is_numbered_optimizer_state, is_stateful


@dataclass
class TensorLeaf:
    """A global tensor and the boxes of it this rank holds, each with a box-shaped view."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: str
    pieces: list[tuple[Box, torch.Tensor]]


@dataclass
class ValueLeaf:
    key: str
    value: Any
    setter: Callable[[Any], None] | None = None


@dataclass
class Flattened:
    """The leaves of a state.

    ``aliases`` maps each further key of a tensor met twice (tied weights) to its first key;
    ``numbered`` lists the prefixes of optimizer state dicts keyed by parameter number;
    ``reductions`` maps the key of each :class:`Replicated` tensor to its ``reduce``.
    """

    tensors: dict[str, TensorLeaf] = field(default_factory=dict)
    values: dict[str, ValueLeaf] = field(default_factory=dict)
    per_rank: dict[str, PerRank] = field(default_factory=dict)
    stateful: list[tuple[StatefulAdapter, dict[str, Any]]] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    numbered: list[str] = field(default_factory=list)
    reductions: dict[str, str] = field(default_factory=dict)

    def keys(self) -> set[str]:
        return set(self.tensors) | set(self.values) | set(self.per_rank) | set(self.aliases)

    def renamed(self, new: Callable[[str], str]) -> Flattened:
        """These leaves with their tensors, values, per-rank values and aliases keyed
        ``new(key)``."""
        return replace(
            self,
            tensors={new(k): replace(t, key=new(k)) for k, t in self.tensors.items()},
            values={new(k): replace(v, key=new(k)) for k, v in self.values.items()},
            per_rank={new(k): v for k, v in self.per_rank.items()},
            aliases={new(k): new(v) for k, v in self.aliases.items()},
        )


KeyMap = Mapping[str, str] | Callable[[str], str | None]
"""How ``keys=`` renames keys: a dict (keys it lacks keep their name) or a function (None: the
key keeps its name). A save's maps the state's keys to the saved ones, a load's the saved keys
to the state's."""


@dataclass(frozen=True)
class Renamed:
    """A flattened state under its saved keys; ``state_keys`` maps each renamed saved key back
    to the state's key (a zero-stall save checks tensors by the keys it captured)."""

    flat: Flattened
    state_keys: dict[str, str]


def rename_for_save(flat: Flattened, keys: KeyMap | None) -> Renamed:
    """``flat`` with every key renamed by ``keys`` (state key to saved key), its reductions and
    numbered prefixes too. Raises :class:`CheckpointError` when two keys of the state get one
    saved key, or a saved key is not a non-empty string."""
    if keys is None:
        return Renamed(flat, {})
    saved: dict[str, str] = {}  # state key -> saved key
    taken: dict[str, str] = {}  # saved key -> state key
    for key in sorted(flat.keys()):
        name = keys.get(key, key) if isinstance(keys, Mapping) else keys(key)
        name = key if name is None else name
        if not isinstance(name, str) or not name:
            raise CheckpointError(
                f"keys= maps '{key}' of the state to {name!r}; expected a non-empty str (or "
                "None to keep the name). Fix the mapping."
            )
        if name in taken:
            raise CheckpointError(
                f"keys= gives '{taken[name]}' and '{key}' of the state the same saved key "
                f"'{name}'; expected one saved key per state key. Fix the mapping."
            )
        taken[name] = key
        saved[key] = name

    def new(key: str) -> str:
        return saved.get(key, key)

    out = replace(
        flat.renamed(new),
        reductions={new(k): r for k, r in flat.reductions.items()},
        numbered=[new(k) for k in flat.numbered],
    )
    return Renamed(out, {s: k for k, s in saved.items() if s != k})


def flatten_state(
    state: dict[str, Any], for_load: bool = False, layout: LayoutMap | None = None
) -> Flattened:
    """Walk ``state`` into leaves, wrapping the tensors at keys ``layout`` matches. Raises
    :class:`CheckpointError` on clashing keys."""
    if not isinstance(state, dict):
        raise CheckpointError(
            f"state is a {type(state).__name__}; expected a dict such as "
            "{'model': model, 'optimizer': optimizer}."
        )
    out = Flattened()
    rules = rules_of(layout) if layout is not None else current_rules()
    _Walker(out, collect_modules(state), for_load, rules).walk_dict(state, "", 0)
    return out


def collect_modules(state: Any) -> list[nn.Module]:
    """Every nn.Module found in the containers of ``state`` (not inside other objects)."""
    found: list[nn.Module] = []
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, nn.Module):
            found.append(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return found


class _Walker:
    def __init__(
        self, out: Flattened, modules: list[nn.Module], for_load: bool, rules: Rules | None = None
    ) -> None:
        self.out = out
        self.rules = rules
        self.modules = modules
        self.for_load = for_load
        self.seen: set[str] = set()
        self.tensor_keys: dict[tuple[Any, ...], str] = {}

    def claim(self, key: str) -> str:
        if key in self.seen:
            raise CheckpointError(
                f"two leaves of the state flatten to the key '{key}' (dict keys are joined "
                "with '.'); rename one of them."
            )
        self.seen.add(key)
        return key

    def walk_dict(self, d: dict[Any, Any], prefix: str, depth: int) -> None:
        for k, v in d.items():
            self.visit(v, f"{prefix}{k}", d, k, depth)

    def visit(self, value: Any, key: str, parent: Any, slot: Any, depth: int) -> None:
        """Walk ``value`` at ``key``, ``depth`` containers below the state (at most
        :data:`~unickpt.format.values.MAX_DEPTH`)."""
        if depth > MAX_DEPTH:
            raise too_deep(key)
        if self.rules is not None and isinstance(value, _TENSOR_LIKE):
            value = self.rules.wrap(key, value)
        if isinstance(value, (dict, list)) and not value:
            self.value(key, value, _setter(parent, slot))
        elif isinstance(value, dict) and not is_stateful(value):
            if is_numbered_optimizer_state(value):
                self.out.numbered.append(key)
            self.walk_dict(value, key + ".", depth + 1)
        elif isinstance(value, list) and _holds_state(value, key, depth):
            for i, v in enumerate(value):
                self.visit(v, f"{key}.{i}", value, i, depth + 1)
        elif isinstance(value, PerRank):
            self.out.per_rank[self.claim(key)] = value
        elif isinstance(value, (torch.Tensor, ShardedTensor, FlatShard, Padded)):
            self.tensor(self.claim(key), value)
        elif isinstance(value, Fused):
            self.fused(self.claim(key), value)
        elif isinstance(value, Replicated):
            self.tensor(self.claim(key), value.tensor)
            if key in self.out.tensors:  # not a further key of a tensor met before (tied)
                self.out.reductions[key] = value.reduce
        elif is_stateful(value):
            adapter = StatefulAdapter(value, self.modules)
            template = adapter.state_dict(self.for_load)
            self.out.stateful.append((adapter, template))
            if is_numbered_optimizer_state(template):
                self.out.numbered.append(key)
            self.walk_dict(template, key + ".", depth + 1)
        else:
            self.value(key, value, _setter(parent, slot))

    def tensor(self, key: str, value: Any) -> None:
        """A tensor leaf, or an alias of the key where the same tensor was met first."""
        _check_storable(key, value, self.for_load)
        identity = tensor_identity(value)
        first = self.tensor_keys.get(identity) if identity is not None else None
        if first is not None:
            self.out.aliases[key] = first
            return
        if identity is not None:
            self.tensor_keys[identity] = key
        self.out.tensors[key] = tensor_leaf(key, value)

    def fused(self, key: str, value: Fused) -> None:
        """One tensor leaf per global tensor the pieces name, under ``{key}.{name}``."""
        _check_storable(key, value.local, self.for_load)
        for name, (shape, pieces) in fused_tensors(value).items():
            sub = self.claim(f"{key}.{name}") if name else key  # "": the key itself
            self.out.tensors[sub] = TensorLeaf(sub, value.local.dtype, shape, "sharded", pieces)

    def value(self, key: str, value: Any, setter: Callable[[Any], None] | None) -> None:
        self.out.values[self.claim(key)] = ValueLeaf(key, value, setter)


_TENSOR_LIKE = (torch.Tensor, ShardedTensor, FlatShard)


def _holds_state(value: Any, key: str, depth: int) -> bool:
    """Whether a container (at ``key``, ``depth`` containers down) holds tensors or objects
    (then it is walked, not stored whole)."""
    if depth > MAX_DEPTH:
        raise too_deep(key)
    if isinstance(value, (*_TENSOR_LIKE, PerRank, *LAYOUT_LEAVES)):
        return True
    if isinstance(value, dict):
        return any(_holds_state(v, key, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_state(v, key, depth + 1) for v in value)
    return is_stateful(value)


def tensor_identity(value: Any) -> tuple[Any, ...] | None:
    """What makes two tensor leaves one tensor: the same memory seen the same way.

    Tied weights (``lm_head.weight`` and ``wte.weight``) give equal identities, whether the
    state holds the parameter itself or a detached view of it. None for tensors without
    memory of their own (empty, meta).
    """
    how: tuple[Any, ...]
    if isinstance(value, Padded):
        inner = tensor_identity(value.leaf)
        return None if inner is None else ("padded", value.global_shape, *inner)
    if isinstance(value, ShardedTensor):
        how = ("sharded", value.global_shape, value.offsets)
    elif isinstance(value, FlatShard):
        how = ("flat", value.global_shape, value.flat_offset)
    elif is_dtensor(value):
        how = ("dtensor", tuple(value.shape), id(value.device_mesh), tuple(value.placements))
    else:
        how = ("plain",)
    local = _local(value)
    if local.device.type == "meta" or local.numel() == 0:
        return None
    layout = (local.data_ptr(), local.dtype, local.device, tuple(local.shape), local.stride())
    return (*how, *layout)


def memory_span(t: torch.Tensor) -> tuple[str, int, int] | None:
    """Where ``t``'s elements lie: its device and the byte range from its first to past its last
    element (None for a tensor without memory: empty, meta)."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    start = t.data_ptr()
    return str(t.device), start, start + (last + 1) * t.element_size()


def _local(value: Any) -> torch.Tensor:
    """The tensor this rank holds of a tensor-like leaf."""
    if isinstance(value, (ShardedTensor, FlatShard)):
        return value.local
    if isinstance(value, Padded):
        return _local(value.leaf)
    return local_tensor(value) if is_dtensor(value) else value


_KINDS = {
    "sparse": "save t.to_dense(), or its indices() and values() as tensors of their own",
    "quantized": "save t.int_repr() with t.q_scale() and t.q_zero_point(), or t.dequantize()",
    "nested": "save t.unbind() (a list of tensors) instead",
}


def _odd_kind(t: torch.Tensor) -> str | None:
    if t.is_nested:
        return "nested"
    if t.layout != torch.strided:
        return "sparse"
    return "quantized" if t.is_quantized else None


def _check_storable(key: str, value: Any, for_load: bool) -> None:
    """Refuse a tensor whose values are not plain strided memory (sparse, quantized, nested),
    one on the meta device (it has none), and, to load into, one whose elements share memory
    (an ``expand``-ed view)."""
    local = _local(value)
    kind = _odd_kind(local)
    if kind is not None:
        raise CheckpointError(
            f"'{key}' is a {kind} tensor of {local.dtype}; unickpt stores dense tensors only: "
            f"{_KINDS[kind]}."
        )
    if local.device.type == "meta" and local.numel():
        if for_load:
            raise CheckpointError(
                f"'{key}' is on the meta device: it has no memory to load into. Allocate the "
                "state before loading (for a model built on meta: model.to_empty(device=...)), "
                "then load."
            )
        raise CheckpointError(
            f"'{key}' is on the meta device: it has no values to save. Materialize it "
            "(model.to_empty(device=...) and initialize) before saving."
        )
    if for_load and any(st == 0 and n > 1 for st, n in zip(local.stride(), local.shape)):
        raise CheckpointError(
            f"'{key}' has elements that share memory (shape {tuple(local.shape)}, stride "
            f"{local.stride()}, as from expand()): a load cannot put different values there. "
            "Load into a tensor of its own (clone() it) and copy from there."
        )


def _setter(parent: Any, slot: Any) -> Callable[[Any], None]:
    def put(v: Any) -> None:
        parent[slot] = v

    return put


def tensor_leaf(key: str, value: Any) -> TensorLeaf:
    """The leaf of a tensor-like value: plain tensor, DTensor, ShardedTensor, FlatShard, or
    one of these padded."""
    if isinstance(value, Padded):
        if isinstance(value.leaf, FlatShard):  # pragma: no cover - Padded refuses it
            raise CheckpointError(f"'{key}': a FlatShard cannot be Padded.")
        held = tensor_leaf(key, value.leaf)
        pieces = clip_pieces(held.pieces, value.global_shape)
        return TensorLeaf(key, held.dtype, value.global_shape, held.layout, pieces)
    if isinstance(value, ShardedTensor):
        local = value.local.detach()
        box = Box(value.offsets, tuple(int(s) for s in local.shape))
        pieces = [(box, local)] if box.numel else []
        return TensorLeaf(key, local.dtype, value.global_shape, "sharded", pieces)
    if isinstance(value, FlatShard):
        return TensorLeaf(key, value.local.dtype, value.global_shape, "flat", _flat_pieces(value))
    if is_dtensor(value):
        local = local_tensor(value).detach()
        pieces = dtensor_pieces(key, value, local)
        return TensorLeaf(key, local.dtype, tuple(int(s) for s in value.shape), "dtensor", pieces)
    t = value.detach()
    shape = tuple(int(s) for s in t.shape)
    pieces = [(Box.whole(shape), t)] if t.numel() else []
    return TensorLeaf(key, t.dtype, shape, "replicated", pieces)


def _flat_pieces(shard: FlatShard) -> list[tuple[Box, torch.Tensor]]:
    local = shard.local.detach()
    if not local.is_contiguous():
        raise CheckpointError(
            "FlatShard.local must be contiguous (it is a range of a flattening); pass "
            "local.contiguous() when saving, or a contiguous buffer to load into."
        )
    flat = local.reshape(-1)
    pieces = []
    pos = 0
    for box in flat_range_to_boxes(shard.global_shape, shard.flat_offset, flat.numel()):
        n = box.numel
        pieces.append((box, flat[pos : pos + n].view(box.lengths)))
        pos += n
    return pieces
