"""Stateful objects: modules, optimizers (keyed by parameter names), anything with state_dict."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

try:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
except ImportError:  # pragma: no cover - torch built without distributed
    get_model_state_dict = None  # type: ignore[assignment]


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


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


def owner_module(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> nn.Module | None:
    """The module whose parameters the optimizer updates, so its state can be keyed by name."""
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for module in modules:
        if params and params <= {id(p) for p in module.parameters()}:
            return module
    return None


class StatefulAdapter:
    """Gets a state dict template from an object and gives it back after loading."""

    def __init__(self, obj: Any, modules: list[nn.Module]) -> None:
        self.obj = obj
        self.model: nn.Module | None = None
        if isinstance(obj, torch.optim.Optimizer) and get_model_state_dict is not None:
            self.model = owner_module(obj, modules)
            if self.model is None:
                log.warning(
                    "no module in the state owns the optimizer's parameters; its state is keyed "
                    "by position and will not reshard. Put the model in the same state dict."
                )

    @property
    def order(self) -> int:
        """Modules load before optimizers, optimizers before anything else."""
        if isinstance(self.obj, nn.Module):
            return 0
        return 1 if isinstance(self.obj, torch.optim.Optimizer) else 2

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.obj, nn.Module) and get_model_state_dict is not None:
            return get_model_state_dict(self.obj)
        if self.model is not None:
            return get_optimizer_state_dict(self.model, self.obj)
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if isinstance(self.obj, nn.Module) and get_model_state_dict is not None:
            set_model_state_dict(self.obj, state_dict, options=StateDictOptions(strict=True))
        elif self.model is not None:
            set_optimizer_state_dict(self.model, self.obj, state_dict)
        else:
            self.obj.load_state_dict(state_dict)
