"""What a zero-stall save takes at the moment of the call, and the proof that the rest held still.

A zero-stall save returns before the state is flattened: flattening, planning and the copy run
in the background while training goes on. So that the checkpoint still holds the values of the
moment of the call, :func:`capture` does, in the call:

- copies the containers (dicts, lists) and takes the state dict of every stateful object
  (modules, optimizers, anything with ``state_dict``), so rebinding ``state["step"]`` or a data
  loader that advances in the next forward pass cannot reach the save; other values (tuples,
  :class:`PerRank` values, arbitrary objects) are deep-copied;
- copies the tensors that may change before the next optimizer step: every buffer of a module
  of the state (BatchNorm's running statistics change in the very next forward pass), every
  plain tensor of at most :data:`COPY_IN_CALL_BYTES` (counters, RNG states, optimizer steps,
  biases), and every tensor without a version counter (created in inference mode);
- keeps every other tensor by reference and records its version counter at the call (an int
  per tensor; for a DTensor two: its own, which DTensor operations move, and its local
  shard's, which operations on the shard move).

The copies made in the call are the extra memory of the call (on each tensor's device); they
are freed when the save ends.

Every optimizer step of the process waits for the copy (:mod:`unickpt.engine.hold`). Any other
in-place change of a tensor kept by reference, between the call and the end of its copy, moves
a version counter: :meth:`Capture.check` then fails the save with a :class:`CheckpointError`
that names the key, and nothing is committed. A tensor is never saved with values of two
moments.

What a version counter sees: every in-place operation through torch, with or without
``torch.no_grad()``, on the tensor in the state, on a view of it, on the tensor it is a view of
(views share one counter, so a change to another part of the same base tensor counts too), on a
detached alias (``detach()``, ``state_dict()`` entries); for a DTensor, operations on it or its
aliases, and on the local shard (``to_local()``) of the very DTensor object the state holds (a
detached DTensor's shard has a counter of its own). What it cannot see: writes
through ``tensor.data`` (a new tensor object with a counter of its own), through NumPy or DLPack
views of the memory, through ``untyped_storage()``, or by kernels that write raw pointers outside
the dispatcher. Such writes must wait for ``future.wait_snapshot()``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..format.values import MAX_DEPTH, too_deep
from ..layouts.dtensor import is_dtensor, local_tensor
from ..layouts.leaves import FlatShard, Fused, Padded, PerRank, Replicated, ShardedTensor
from .flatten import collect_modules
from .stateful import StatefulAdapter, is_stateful

COPY_IN_CALL_BYTES = 64 * 1024
"""Plain tensors of at most this many bytes are copied in the call (DTensors are not: each
copy goes through DTensor's dispatcher)."""

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes)


class Captured:
    """The state dict of a stateful object, taken at the call; saved exactly as the object."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise TypeError("a captured state dict is for saving only")


_Watch = tuple[tuple[torch.Tensor, int], ...]


@dataclass(frozen=True)
class Capture:
    """A state as it was at the call: ``state`` to flatten; for every tensor key kept by
    reference, the tensors whose version counters must not move and their versions at the call
    (``watched``); ``copied``, the keys of tensors copied in the call."""

    state: dict[str, Any]
    watched: dict[str, _Watch]
    copied: frozenset[str]

    def check(self, key: str) -> None:
        """Raise when the tensor saved under ``key`` changed in place since the call (for the
        piece ``{key}.{name}`` of a fused tensor, when the tensor at ``key`` did)."""
        key = self._recorded(key)
        watch = self.watched.get(key)
        if watch is None:
            return
        for tensor, expected in watch:
            found = tensor._version
            if found != expected:
                raise CheckpointError(
                    f"'{key}' was changed in place after the zero-stall save was called and "
                    f"before its copy finished (its version counter went from {expected} to "
                    f"{found}); a checkpoint never holds values of two moments, so this save was "
                    "not committed. A zero-stall save keeps large tensors by reference: change "
                    "them only in optimizer.step() (which waits for the copy) or after "
                    "future.wait_snapshot(), or save with zero_stall=False (a Checkpointer: "
                    "mode='async')."
                )

    def _recorded(self, key: str) -> str:
        """The key recorded at the call that ``key`` is, or is a piece of."""
        found = key
        while found not in self.watched and found not in self.copied and "." in found:
            found = found.rsplit(".", 1)[0]
        assert found in self.watched or found in self.copied, (
            f"no version recorded at the call for '{key}'"
        )
        return found


def capture(state: dict[str, Any]) -> Capture:
    """``state`` as it is now, safe to flatten and copy later; see the module docstring."""
    capturer = _Capturer(collect_modules(state))
    with torch.no_grad():  # once: entering it costs more than copying a small tensor
        captured = capturer.walk_dict(state, "")
    return Capture(captured, capturer.watched, frozenset(capturer.copied))


class _Capturer:
    """Walks a state as flattening will, with the same keys (dict keys joined by '.', list
    items by index, a stateful object's state dict under its key)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.buffers: set[int] = set()  # addresses: state dicts hold detached aliases
        for m in modules:
            self.add_buffers(m)
        self.watched: dict[str, _Watch] = {}
        self.copied: set[str] = set()
        self.copies: dict[int, torch.Tensor] = {}  # a tensor under two keys stays one tensor

    def add_buffers(self, module: nn.Module) -> None:
        self.buffers.update(_address(b) for b in module.buffers() if b.numel())

    def walk_dict(self, d: dict[Any, Any], prefix: str, depth: int = 0) -> dict[Any, Any]:
        return {k: self.visit(v, f"{prefix}{k}", depth) for k, v in d.items()}

    def visit(self, value: Any, key: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise too_deep(key)
        if isinstance(value, torch.Tensor):
            return self.tensor(value, key)
        if isinstance(value, (ShardedTensor, FlatShard, Fused)):
            local = self.tensor(value.local, key)
            return value if local is value.local else replace(value, local=local)
        if isinstance(value, Padded):
            return replace(value, leaf=self.visit(value.leaf, key))
        if isinstance(value, Replicated):
            return replace(value, tensor=self.tensor(value.tensor, key))
        if isinstance(value, PerRank):
            return replace(value, value=self.plain(value.value, key))
        if isinstance(value, dict) and not is_stateful(value):
            return self.walk_dict(value, key + ".", depth + 1)
        if isinstance(value, list):
            return [self.visit(v, f"{key}.{i}", depth + 1) for i, v in enumerate(value)]
        if is_stateful(value):
            return self.stateful(value, key)
        return self.plain(value, key)

    def stateful(self, obj: Any, key: str) -> Captured:
        if not isinstance(obj, (nn.Module, torch.optim.Optimizer)):
            # A trainer object holding its model: that model's buffers are buffers too.
            for attr in getattr(obj, "__dict__", {}).values():
                if isinstance(attr, nn.Module):
                    self.add_buffers(attr)
        taken = StatefulAdapter(obj, self.modules).state_dict()
        if isinstance(taken, dict):
            return Captured(self.walk_dict(taken, key + "."))
        return Captured(self.plain(taken, key))

    def tensor(self, t: torch.Tensor, key: str) -> torch.Tensor:
        dtensor = is_dtensor(t)
        local = local_tensor(t) if dtensor else t
        if not dtensor and local.nbytes <= COPY_IN_CALL_BYTES:
            return self.copy(t, key)
        if self.buffers and local.data_ptr() in self.buffers:
            return self.copy(t, key)
        try:
            # DTensor operations move the DTensor's own counter (shared by its detached
            # aliases); operations on the local shard move the local tensor's.
            watch = (t, local) if dtensor else (t,)
            self.watched[key] = tuple((w, w._version) for w in watch)
        except RuntimeError:  # no version counter: created in inference mode
            return self.copy(t, key)
        return t

    def copy(self, t: torch.Tensor, key: str) -> torch.Tensor:
        self.copied.add(key)
        found = self.copies.get(id(t))
        if found is None:
            found = self.copies[id(t)] = t.detach().clone()
        return found

    def plain(self, value: Any, key: str, depth: int = 0) -> Any:
        """A value stored whole (encoded later): a private copy of it."""
        if depth > MAX_DEPTH:
            raise too_deep(key)
        if isinstance(value, _IMMUTABLE):
            return value
        if isinstance(value, torch.Tensor):
            return value.detach().clone()  # deepcopy refuses tensors with a graph
        if type(value) in (list, tuple):
            return type(value)(self.plain(v, key, depth + 1) for v in value)
        if type(value) is dict:
            return {k: self.plain(v, key, depth + 1) for k, v in value.items()}
        try:
            return copy.deepcopy(value)
        except Exception as e:
            raise CheckpointError(
                f"'{key}' holds a {type(value).__qualname__} that cannot be copied at the call "
                f"of a zero-stall save ({type(e).__name__}: {e}); give it "
                "state_dict()/load_state_dict(), or save with zero_stall=False (a Checkpointer: "
                "mode='async')."
            ) from e


def _address(t: torch.Tensor) -> int:
    """Where a tensor's first element lies; the same for a tensor and its detached aliases
    (unique across devices: CUDA and host memory share one virtual address space)."""
    return (local_tensor(t) if is_dtensor(t) else t).data_ptr()
