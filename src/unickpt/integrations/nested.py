"""A framework's checkpoint dict, any nesting, saved as a unickpt checkpoint and read back whole.

Trainers hand their checkpoint plugins one nested dict (model and optimizer state dicts, loop
counters, callback states) and expect the same dict back on load, with no template to load
into. It is stored as two entries: ``tensors.<path>`` (every tensor, keyed by the dotted path of
its place: ``tensors.state_dict.layer.weight``, ``tensors.optimizer_states.0.state.0.exp_avg``)
and ``layout``, a JSON string of the structure with each tensor replaced by its key. Dicts with
any keys, lists and tuples keep their types; other objects are pickled only when allowed.

>>> save_nested("ckpt/epoch=0-step=10.ckpt", trainer_dict)  # doctest: +SKIP
>>> load_nested("ckpt/epoch=0-step=10.ckpt")  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .. import api
from ..config import get_config
from ..dist import Comm, on_every_rank
from ..engine.futures import SaveFuture
from ..errors import CheckpointCorruptError, CheckpointError, UnsafeObjectError
from ..format.dtypes import dtype_from_name
from ..tools import inspect_checkpoint

T = TypeVar("T")

TENSORS = "tensors"
LAYOUT = "layout"
FORMAT = "unickpt-nested-1"


def split(obj: Any, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of ``obj`` by path, and its structure as JSON referring to them."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, torch.Tensor):
            key = path or "_"
            while key in tensors:
                key += "_"
            tensors[key] = value
            return {"$tensor": key}
        if isinstance(value, dict):
            items = [[enc(k, f"{path}.k"), enc(v, _join(path, k))] for k, v in value.items()]
            return {"$map": items}
        if type(value) in (list, tuple):
            tag = "$list" if isinstance(value, list) else "$tuple"
            return {tag: [enc(v, _join(path, i)) for i, v in enumerate(value)]}
        if not allow_pickle:
            raise UnsafeObjectError(
                f"'{path}' of the checkpoint holds a {type(value).__module__}."
                f"{type(value).__qualname__}, which is stored only with pickle; pass "
                "allow_pickle=True if you trust whoever loads it, or leave the object out."
            )
        return {"$pickle": base64.b64encode(pickle.dumps(value)).decode("ascii")}

    layout = enc(obj, "")
    return tensors, json.dumps({"format": FORMAT, "root": layout})


def join(layout: str, tensors: dict[str, torch.Tensor], allow_pickle: bool) -> Any:
    """Inverse of :func:`split`."""
    doc = json.loads(layout)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointCorruptError(
            f"the checkpoint's layout is not in format {FORMAT}; it was not written by "
            "unickpt's framework integrations, load it with unickpt.load."
        )

    def dec(value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        ((tag, body),) = value.items()
        if tag == "$tensor":
            return tensors[body]
        if tag == "$map":
            return {_hashable(dec(k)): dec(v) for k, v in body}
        if tag in ("$list", "$tuple"):
            items = [dec(v) for v in body]
            return items if tag == "$list" else tuple(items)
        if tag == "$float":
            return float(body)
        if tag == "$pickle":
            if not allow_pickle:
                raise UnsafeObjectError(
                    "the checkpoint holds pickled objects; pass allow_pickle=True to load "
                    "them if you trust the checkpoint."
                )
            return pickle.loads(base64.b64decode(body))
        raise CheckpointCorruptError(f"unknown tag {tag!r} in the checkpoint's layout")

    return dec(doc["root"])


def to_state(obj: Any, allow_pickle: bool) -> dict[str, Any]:
    """The unickpt state that stores ``obj``: ``layout`` and, when it has tensors, ``tensors``."""
    tensors, layout = split(obj, allow_pickle)
    state: dict[str, Any] = {LAYOUT: layout}
    if tensors:
        state[TENSORS] = tensors
    return state


def template(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A state to load :func:`to_state`'s entries of the checkpoint at ``path`` into (empty
    CPU tensors of the saved shapes)."""
    summary = inspect_checkpoint(path)
    prefix = TENSORS + "."
    tensors = {
        t.key[len(prefix) :]: torch.empty(t.shape, dtype=dtype_from_name(t.dtype))
        for t in summary.tensors
        if t.key.startswith(prefix)
    }
    state: dict[str, Any] = {LAYOUT: ""}
    if tensors:
        state[TENSORS] = tensors
    return state


def from_state(state: dict[str, Any], allow_pickle: bool) -> Any:
    """The object a loaded :func:`template` holds."""
    return join(state[LAYOUT], state.get(TENSORS, {}), allow_pickle)


def save_nested(
    path: str | os.PathLike[str],
    obj: dict[str, Any],
    *,
    group: Any = None,
    allow_pickle: bool = False,
    asynchronous: bool = False,
) -> SaveFuture:
    """Save ``obj`` at ``path`` (replacing a checkpoint there); asynchronous when asked."""
    state = every_rank(group, "preparing the save", lambda: to_state(obj, allow_pickle))
    if asynchronous:
        return api.async_save(path, state, group=group, overwrite=True)
    return SaveFuture.completed(api.save(path, state, group=group, overwrite=True))


def load_nested(
    path: str | os.PathLike[str], *, group: Any = None, allow_pickle: bool = False
) -> Any:
    """The object :func:`save_nested` saved at ``path``, tensors on the CPU."""
    state = every_rank(group, "reading what the checkpoint holds", lambda: template(path))
    try:
        api.load(path, state, group=group)
    except CheckpointError as e:
        raise CheckpointError(
            f"{path} is not a checkpoint written by unickpt's framework integrations ({e})"
        ) from e
    return from_state(state, allow_pickle)


def every_rank(group: Any, what: str, fn: Callable[[], T]) -> T:
    """``fn()`` on every rank of ``group`` (None: the world), its failure on any rank raised on
    every rank: what a rank prepares alone before a collective save or load."""
    return on_every_rank(Comm(group, get_config().collective_timeout_s), what, fn)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
