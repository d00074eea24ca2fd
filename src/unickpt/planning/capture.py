"""What a save whose planning is deferred must capture at the moment of the call.

A zero-stall save returns before the state is flattened: flattening, planning and the copy
run in the background until the next optimizer step. Tensor values may be read then, since
they change only in the step, which waits. Everything else may change sooner: the caller
rebinds dict entries (``state["step"] = 101``), a data loader advances in the very next
forward pass, and FSDP2 swaps a module's sharded parameters for gathered ones during forward
and backward. :func:`capture` therefore copies the containers and takes the state dict of
every stateful object (modules and optimizers included) now; tensors are kept by reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .stateful import StatefulAdapter, collect_modules, is_stateful


class Captured:
    """The state dict of a stateful object, taken at the call; saved exactly as the object."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise TypeError("a captured state dict is for saving only")


def capture(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` that later changes to anything but tensor values cannot reach."""
    return _Capturer(collect_modules(state)).copy_dict(state)


class _Capturer:
    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules

    def copy_dict(self, d: dict[Any, Any]) -> dict[Any, Any]:
        return {k: self.capture(v) for k, v in d.items()}

    def capture(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, dict) and not is_stateful(value):
            return self.copy_dict(value)
        if isinstance(value, list):
            return [self.capture(v) for v in value]
        if is_stateful(value):
            taken = StatefulAdapter(value, self.modules).state_dict()
            return Captured(self.copy_dict(taken) if isinstance(taken, dict) else taken)
        return value
