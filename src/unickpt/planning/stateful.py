"""Stateful objects: modules, optimizers (keyed by parameter names), anything with state_dict.

Modules give their own ``state_dict()`` (DDP and ``torch.compile`` wrappers unwrapped, so keys
never carry ``module.`` or ``_orig_mod.``); optimizers give theirs with parameter ids replaced
by parameter names, so optimizer state reshards with the model. Both are references to the
live tensors, so a load fills them in place. FSDP1 wrappers go through
``torch.distributed.checkpoint.state_dict``, which knows their flat parameters.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

try:
    from torch.distributed.checkpoint import state_dict as dcp_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.nn.parallel import DistributedDataParallel as DDP
except ImportError:  # pragma: no cover - torch built without distributed
    dcp_state_dict = None  # type: ignore[assignment]
    FSDP1 = DDP = ()  # type: ignore[assignment,misc]


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside DDP and ``torch.compile`` wrappers."""
    while True:
        if isinstance(module, DDP):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        else:
            return module


def module_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()``, built straight from parameters and persistent buffers when no
    module in the tree customizes its state dict beyond pre-hooks (post-hooks, extra state, an
    overridden save); pre-hooks (FSDP2's, which reshards parameters) run as usual.

    The same keys and tensors, without ``state_dict``'s per-tensor ``detach()``, which for a
    DTensor goes through its dispatcher (~60 us each); flattening detaches the local shards.
    """
    if not all(_plain_state_dict(m) for m in module.modules()):
        return module.state_dict()
    out: dict[str, Any] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for hook in m._state_dict_pre_hooks.values():
            hook(m, dot, False)
        for name, p in m._parameters.items():
            if p is not None:
                out[dot + name] = p
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[dot + name] = b
    return out


def _plain_state_dict(m: nn.Module) -> bool:
    cls = type(m)
    return (
        not m._state_dict_hooks
        and cls.state_dict is nn.Module.state_dict
        and cls._save_to_state_dict is nn.Module._save_to_state_dict
        and cls.get_extra_state is nn.Module.get_extra_state
    )


def is_numbered_optimizer_state(value: Any) -> bool:
    """Whether ``value`` has ``torch.optim.Optimizer.state_dict()``'s format: state keyed by
    parameter number, param groups listing numbers."""
    if not isinstance(value, dict) or set(value) != {"state", "param_groups"}:
        return False
    state, groups = value["state"], value["param_groups"]
    return (
        isinstance(state, dict)
        and all(isinstance(k, int) for k in state)
        and isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        and all(isinstance(p, int) for g in groups for p in g["params"])
    )


def owner_module(
    optimizer: torch.optim.Optimizer, modules: list[nn.Module]
) -> tuple[nn.Module, dict[int, str]] | None:
    """The module whose parameters the optimizer updates, with the names of its parameters
    by ``id``, so the optimizer's state can be keyed by name."""
    params = _optimizer_order(optimizer)
    if not params:
        return None
    for module in modules:
        names = {id(p): n for n, p in unwrap(module).named_parameters()}
        if all(id(p) in names for p in params):
            return module, names
    return None


class StatefulAdapter:
    """Gets a state dict template from an object and gives it back after loading.

    An optimizer whose ``state_dict()`` has torch's format (state keyed by parameter number)
    is keyed by parameter name here; an optimizer class with a format of its own (an
    optimizers container keyed by names) is an object like any other.
    """

    def __init__(self, obj: Any, modules: list[nn.Module]) -> None:
        self.obj = obj
        self.model: nn.Module | None = None
        self.names: dict[int, str] = {}
        self._taken: dict[str, Any] | None = None
        self.numbered = isinstance(obj, torch.optim.Optimizer) and self._torch_format()
        if self.numbered:
            owner = owner_module(obj, modules)
            if owner is not None:
                self.model, self.names = owner
            else:
                log.warning(
                    "no module in the state owns the optimizer's parameters; its state is keyed "
                    "by position and will not reshard. Put the model in the same state dict."
                )
        target = obj if isinstance(obj, nn.Module) else self.model
        self.fsdp1 = target is not None and any(isinstance(m, FSDP1) for m in target.modules())

    def _torch_format(self) -> bool:
        """Whether the optimizer's state dict is torch's (asking it only if its class has its
        own ``state_dict``; that answer is kept for the first :meth:`state_dict`)."""
        if type(self.obj).state_dict is torch.optim.Optimizer.state_dict:
            return True
        taken = self.obj.state_dict()
        if is_numbered_optimizer_state(taken):
            return True
        self._taken = taken
        return False

    @property
    def order(self) -> int:
        """Modules load before optimizers, optimizers before anything else."""
        if isinstance(self.obj, nn.Module):
            return 0
        return 1 if isinstance(self.obj, torch.optim.Optimizer) else 2

    def state_dict(self, for_load: bool = False) -> dict[str, Any]:
        if self.fsdp1 and dcp_state_dict is not None:
            if isinstance(self.obj, nn.Module):
                return dcp_state_dict.get_model_state_dict(self.obj)
            assert self.model is not None
            return dcp_state_dict.get_optimizer_state_dict(self.model, self.obj)
        if isinstance(self.obj, nn.Module):
            return module_state_dict(unwrap(self.obj))
        if self.model is not None:
            if for_load and not self.obj.state and dcp_state_dict is not None:
                dcp_state_dict._init_optim_state(self.obj)
            return _named_optimizer_state(self.obj, self.names)
        if self._taken is not None:
            taken, self._taken = self._taken, None
            return taken
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.fsdp1 and dcp_state_dict is not None:
            if isinstance(self.obj, nn.Module):
                dcp_state_dict.set_model_state_dict(self.obj, state_dict)
            else:
                assert self.model is not None
                dcp_state_dict.set_optimizer_state_dict(self.model, self.obj, state_dict)
        elif isinstance(self.obj, nn.Module):
            module = unwrap(self.obj)
            if not _filled_in_place(module, state_dict):
                module.load_state_dict(state_dict)
        elif self.model is not None:
            self.obj.load_state_dict(_indexed_optimizer_state(self.obj, self.names, state_dict))
        else:
            self.obj.load_state_dict(state_dict)


def _filled_in_place(module: nn.Module, loaded: dict[str, Any]) -> bool:
    """Whether every loaded entry already is the module's own tensor (nothing to copy)."""
    current = module.state_dict()
    if current.keys() != loaded.keys():
        return False
    for key, value in loaded.items():
        mine = current[key]
        if not (isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor)):
            return False
        if value is not mine and _storage_ptr(value) != _storage_ptr(mine):
            return False
    return True


def _storage_ptr(t: torch.Tensor) -> tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.untyped_storage().data_ptr()), int(local.storage_offset())


def _optimizer_order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in the order ``Optimizer.state_dict`` numbers them."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def _named_optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> dict[str, Any]:
    order = [names[id(p)] for p in _optimizer_order(optimizer)]
    sd = optimizer.state_dict()
    return {
        "state": {order[i]: v for i, v in sd["state"].items()},
        "param_groups": [
            {**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]
        ],
    }


def _indexed_optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str], named: dict[str, Any]
) -> dict[str, Any]:
    index = {names[id(p)]: i for i, p in enumerate(_optimizer_order(optimizer))}
    return {
        "state": {index[n]: v for n, v in named["state"].items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]
        ],
    }
