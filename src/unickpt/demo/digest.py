"""A fingerprint of the whole training state that does not depend on how it is sharded.

Two states have the same digest exactly when every model tensor and every optimizer state
tensor holds the same bits, whatever the world size: sharded tensors are gathered first. The
demo uses it to check that a loaded state is the state that was saved, and whether a run's
state is still the reference run's.

Call it on every rank at the same point (gathering is a collective); every rank gets the same
digest.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The hex digest of the model's state_dict and the optimizer's per-parameter state."""
    digest = hashlib.blake2b(digest_size=16)
    for name, value in model.state_dict().items():
        _add(digest, f"model.{name}", value)
    states = optimizer.state_dict()["state"]
    for index in sorted(states):
        for key in sorted(states[index]):
            _add(digest, f"optimizer.{index}.{key}", states[index][key])
    return digest.hexdigest()


def _add(digest: Any, name: str, value: Any) -> None:
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value)
    tensor = value.detach().cpu().contiguous()
    digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
    digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
