"""Layout-independent fingerprints of a training state, to check that a load restored it.

Each tensor is reduced to (sum, sum of |x|) in float64 over its local shard, then summed over
ranks, so a ``Shard(0)`` and a ``Shard(1)`` copy of the same values give the same numbers up
to rounding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from unickpt.bench.model import TrainState

Fingerprint = dict[str, tuple[float, float]]

_REL_TOL = 1e-6


def fingerprint(state: TrainState) -> Fingerprint:
    """Collective: every rank calls it in the same order."""
    names: list[str] = []
    local: list[torch.Tensor] = []
    for name, param in state.model.named_parameters():
        names.append(name)
        local.append(_reduce(param))
        for key, value in sorted(state.optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor) and key != "step":
                names.append(f"{name}.{key}")
                local.append(_reduce(value))
    stacked = torch.stack(local)
    dist.all_reduce(stacked)
    return {name: (float(row[0]), float(row[1])) for name, row in zip(names, stacked)}


def _reduce(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    data = (to_local() if callable(to_local) else tensor).detach().to(torch.float64)
    return torch.stack([data.sum(), data.abs().sum()])


def mismatches(expected: Fingerprint, actual: Fingerprint) -> list[str]:
    """Names whose fingerprints differ beyond rounding, plus names missing on either side."""
    bad = sorted(set(expected) ^ set(actual))
    for name in sorted(set(expected) & set(actual)):
        (es, ea), (as_, aa) = expected[name], actual[name]
        scale = max(ea, aa, 1e-30)
        if abs(es - as_) > _REL_TOL * scale or abs(ea - aa) > _REL_TOL * scale:
            bad.append(name)
    return bad


def perturb(state: TrainState) -> None:
    """Overwrite parameters and moments so that a load that does nothing is caught."""
    with torch.no_grad():
        for param in state.model.parameters():
            param.mul_(0.5).add_(1.0)
            for key, value in state.optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and key != "step":
                    value.mul_(0.5).add_(1.0)
