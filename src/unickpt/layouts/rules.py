"""``layout=``: patterns of flattened keys mapped to functions that wrap the tensor found there.

A model's fused and padded tensors are named alike in every layer, so one map describes them
all, as DeepSpeed's universal checkpoint patterns do, but applied at save and at load:

>>> import unickpt
>>> layout = {
...     "*.linear_fc1.weight": unickpt.fused_glu(tp_rank=0, tp_size=2),
...     "*.linear_qkv.weight": unickpt.fused_qkv(0, 2, num_query_groups=8, heads_per_group=4,
...                                              head_dim=64),
...     "*.word_embeddings.weight": unickpt.padded_vocab(50257, tp_rank=0, tp_size=2),
...     "*.layernorm.weight": unickpt.replicated("check"),
... }
>>> # unickpt.save(path, state, layout=layout); unickpt.load(path, state, layout=layout)

Patterns are :func:`fnmatch.fnmatchcase` patterns (``*`` crosses dots) over the keys of the
flattened state (``model.decoder.layers.0.mlp.linear_fc1.weight``); the first pattern that
matches a tensor's key wins, and a pattern that matches nothing is no error (a model without
biases). Only tensor leaves (tensors, DTensors, ShardedTensor, FlatShard) are offered.

:func:`applying` makes a map the one that flattening uses in its scope (the API enters it
around a save's planning and a load), so the engine's signatures need not carry it.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from .dtensor import is_dtensor
from .leaves import Fused, FusedPiece, Padded, Replicated, ShardedTensor

Wrap = Callable[[Any], Any]
LayoutMap = Mapping[str, Wrap]
"""``{pattern of flattened keys: function(tensor) -> leaf}``."""


@dataclass(frozen=True)
class Rules:
    """A checked layout map, in its order."""

    entries: tuple[tuple[str, Wrap], ...]

    def wrap(self, key: str, value: Any) -> Any:
        """``value`` wrapped by the first entry whose pattern matches ``key``, else itself."""
        for pattern, fn in self.entries:
            if fnmatch.fnmatchcase(key, pattern):
                return _call(fn, pattern, key, value)
        return value


def rules_of(layout: LayoutMap | None) -> Rules | None:
    """Check a ``layout=`` argument: a mapping of string patterns to functions."""
    if layout is None:
        return None
    if not isinstance(layout, Mapping):
        raise CheckpointError(
            f"layout is a {type(layout).__name__}; expected a dict of key patterns to functions, "
            "such as {'*.linear_fc1.weight': unickpt.fused_glu(tp_rank, tp_size)}."
        )
    for pattern, fn in layout.items():
        if not isinstance(pattern, str) or not callable(fn):
            raise CheckpointError(
                f"layout entry {pattern!r}: {fn!r}: expected a string pattern of flattened keys "
                "mapped to a function of the tensor (unickpt.fused_glu(...), padded_vocab(...), "
                "replicated(...) or your own)."
            )
    return Rules(tuple(layout.items()))


_CURRENT: contextvars.ContextVar[Rules | None] = contextvars.ContextVar(
    "unickpt_layout", default=None
)


@contextlib.contextmanager
def applying(layout: LayoutMap | None) -> Iterator[None]:
    """Flatten with ``layout`` within this block (of this thread); checked on entry."""
    token = _CURRENT.set(rules_of(layout))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_rules() -> Rules | None:
    """The layout map of the innermost :func:`applying` block, if any."""
    return _CURRENT.get()


def _call(fn: Wrap, pattern: str, key: str, value: Any) -> Any:
    try:
        return fn(value)
    except Exception as e:
        raise CheckpointError(
            f"'{key}' (layout pattern {pattern!r}): {e}"
            if isinstance(e, CheckpointError)
            else f"'{key}' (layout pattern {pattern!r}): the layout function raised "
            f"{type(e).__name__}: {e}"
        ) from e


def _check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise CheckpointError(
            f"tp_rank {tp_rank} of tp_size {tp_size}: expected 0 <= tp_rank < tp_size."
        )


def _plain(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or is_dtensor(t):
        raise CheckpointError(
            f"{what} expects the plain tensor this tensor-parallel rank holds, found a "
            f"{type(t).__name__}."
        )
    return t


def _at(ndim: int, dim: int, value: int) -> tuple[int, ...]:
    return tuple(value if d == dim else 0 for d in range(ndim))


def fused_glu(
    tp_rank: int, tp_size: int, dim: int = 0, names: tuple[str, str] = ("gate", "up")
) -> Wrap:
    """Gate and up halves of a gated MLP's first projection (Megatron's ``linear_fc1`` with
    SwiGLU), each sharded over ``tp_size`` ranks along ``dim``: the local tensor is this rank's
    gate rows, then its up rows. Saved as ``{key}.gate`` and ``{key}.up``."""
    _check_tp(tp_rank, tp_size)

    def wrap(t: Any) -> Fused:
        local = _plain(t, "fused_glu")
        d = dim % max(local.dim(), 1)
        n = local.shape[d] if local.dim() else 0
        if n % 2:
            raise CheckpointError(
                f"fused_glu: the local tensor has {n} along dim {d} (shape "
                f"{tuple(local.shape)}); gate and up halves need an even size."
            )
        half = n // 2
        shape = tuple(half * tp_size if i == d else s for i, s in enumerate(local.shape))
        offsets = _at(local.dim(), d, tp_rank * half)
        return Fused(local, d, [FusedPiece(m, shape, offsets, half) for m in names])

    return wrap


def fused_qkv(
    tp_rank: int,
    tp_size: int,
    num_query_groups: int,
    heads_per_group: int,
    head_dim: int,
    names: tuple[str, str, str] = ("q", "k", "v"),
) -> Wrap:
    """Megatron's ``linear_qkv`` (weight or bias): along dim 0, per query group, its
    ``heads_per_group`` query heads, then one key head, then one value head, each ``head_dim``
    rows; the query groups sharded over ``tp_size`` ranks. Saved as ``{key}.q`` (all query
    heads in order), ``{key}.k`` and ``{key}.v``."""
    _check_tp(tp_rank, tp_size)
    if num_query_groups % tp_size:
        raise CheckpointError(
            f"fused_qkv: {num_query_groups} query groups do not split over tp_size {tp_size}; "
            "the number of query groups must be a multiple of the tensor-parallel size."
        )
    groups = num_query_groups // tp_size
    q_rows = heads_per_group * head_dim

    def wrap(t: Any) -> Fused:
        local = _plain(t, "fused_qkv")
        rows = groups * (q_rows + 2 * head_dim)
        if local.dim() == 0 or local.shape[0] != rows:
            raise CheckpointError(
                f"fused_qkv: the local tensor has shape {tuple(local.shape)}; {groups} query "
                f"groups of {heads_per_group} query heads, a key and a value head of {head_dim} "
                f"make {rows} rows along dim 0. Check num_query_groups, heads_per_group, "
                "head_dim and tp_size."
            )
        rest = tuple(local.shape[1:])
        zeros = tuple(0 for _ in rest)
        q_shape = (num_query_groups * q_rows, *rest)
        kv_shape = (num_query_groups * head_dim, *rest)
        pieces = []
        for g in range(tp_rank * groups, (tp_rank + 1) * groups):
            pieces.append(FusedPiece(names[0], q_shape, (g * q_rows, *zeros), q_rows))
            pieces.append(FusedPiece(names[1], kv_shape, (g * head_dim, *zeros), head_dim))
            pieces.append(FusedPiece(names[2], kv_shape, (g * head_dim, *zeros), head_dim))
        return Fused(local, 0, pieces)

    return wrap


def padded_vocab(vocab_size: int, tp_rank: int = 0, tp_size: int = 1, dim: int = 0) -> Wrap:
    """A vocabulary-sized tensor padded along ``dim`` (embedding, output layer): only its first
    ``vocab_size`` rows are saved and loaded. A plain tensor is this rank's shard of
    ``tp_size`` equal vocabulary-parallel shards; a DTensor or ShardedTensor says where it lies
    itself (``tp_rank`` and ``tp_size`` are then not used)."""
    _check_tp(tp_rank, tp_size)

    def wrap(t: Any) -> Padded:
        if isinstance(t, ShardedTensor):
            held = t.global_shape
        elif isinstance(t, torch.Tensor) and (is_dtensor(t) or tp_size == 1):
            held = tuple(int(s) for s in t.shape)
        else:
            local = _plain(t, "padded_vocab")
            n = local.shape[dim]
            held = tuple(
                s * tp_size if i == dim % local.dim() else s for i, s in enumerate(local.shape)
            )
            t = ShardedTensor(local, held, _at(local.dim(), dim % local.dim(), tp_rank * n))
        logical = tuple(vocab_size if i == dim % len(held) else s for i, s in enumerate(held))
        return Padded(t, logical)

    return wrap


def replicated(reduce: str = "check") -> Wrap:
    """Values every tensor-parallel rank holds alike (LayerNorm weights): ``"check"`` fails the
    save when the copies differ, ``"mean"`` saves their mean (see :class:`~unickpt.Replicated`)."""
    Replicated(torch.zeros(1), reduce)  # checks reduce now, not at the first save
    return lambda t: Replicated(t, reduce)
