"""This rank's random number generators as one stateful object of a state.

A state that holds ``torch.get_rng_state()`` taken once saves that moment's state at every
later save: a loop with dropout then resumes with other masks than an uninterrupted run.
:class:`RNGState` reads the generators when a save takes its state and sets them when a load
gives it back, so a resumed run draws the numbers the uninterrupted one drew.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError
from .layouts.leaves import PerRank, Reshard

_KEY = "generators"


class RNGState:
    """Python's, NumPy's, torch's CPU and every CUDA device's generator state of this rank.

    Put it in the state; each save reads the generators (``state_dict``), each load sets them
    (``load_state_dict``). The states are a :class:`unickpt.PerRank` value: every rank gets its
    own back; on another world size, rank ``r`` gets the ``r``-th saved state where there is
    one and the others keep their generators (``on_world_change`` as for ``PerRank`` chooses
    otherwise: ``"warn"`` to be told, ``"error"`` to refuse). CUDA states
    are read only once CUDA is initialized (reading them would initialize it) and set on the
    devices both the saving and the loading rank have.

    >>> state = {"model": model, "rng": unickpt.RNGState()}  # doctest: +SKIP
    >>> unickpt.save("ckpt/step-100", state)  # doctest: +SKIP
    >>> unickpt.load("ckpt/step-100", state)  # the generators of step 100 again  # doctest: +SKIP
    """

    def __init__(self, on_world_change: str | Reshard | None = None) -> None:
        self.on_world_change: str | Reshard = on_world_change or _own_or_current

    def state_dict(self) -> dict[str, Any]:
        """The generators' states now, as one per-rank value."""
        return {_KEY: PerRank(read_generators(), self.on_world_change)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the generators to the states ``state_dict`` holds (as :meth:`state_dict` gave
        them, or loaded into that)."""
        found = state_dict.get(_KEY) if isinstance(state_dict, dict) else None
        value = found.value if isinstance(found, PerRank) else found
        if not isinstance(value, dict) or "torch" not in value:
            raise CheckpointError(
                f"RNGState.load_state_dict got {type(state_dict).__name__} "
                f"{_short(state_dict)}; expected {{'{_KEY}': states}} as RNGState.state_dict() "
                "gives it. Load a checkpoint saved with an RNGState at this key."
            )
        set_generators(value)


def read_generators() -> dict[str, Any]:
    """This process's generator states, in values a checkpoint stores without pickle."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    found: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        found["cuda"] = list(torch.cuda.get_rng_state_all())
    return found


def set_generators(states: dict[str, Any]) -> None:
    """Set this process's generators to ``states`` (as :func:`read_generators` gave them)."""
    python = states.get("python")
    if python is not None:
        version, internal, gauss = python
        random.setstate((version, tuple(internal), gauss))
    numpy = states.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda") or []
    if cuda and torch.cuda.is_available():
        for device, state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


def _own_or_current(saved: list[Any], world_size: int, rank: int) -> Any:
    """On another world size: the ``rank``-th saved state, else this rank's generators now."""
    return saved[rank] if rank < len(saved) else read_generators()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
