"""The keys a save writes: the flattened state's keys, renamed by ``keys=``.

``unickpt.save(out, {"model": model}, format="safetensors", keys=lambda k:
k.removeprefix("model."))`` writes the names ``from_pretrained`` reads; a load takes the
inverse map (``keys=lambda k: "model." + k``). The renaming is applied to the flattened state
before anything else sees its keys, so the plan, the metadata, ``quantize`` and ``row_deltas``
name the saved keys; ``layout=`` patterns, applied while flattening, name the state's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from ..errors import CheckpointError
from .flatten import Flattened
from .load_keys import KeyMap, rename_for_load


@dataclasses.dataclass(frozen=True)
class Renamed:
    """A flattened state under its saved keys; ``state_keys`` maps each renamed saved key back
    to the state's key (a zero-stall save checks tensors by the keys it captured)."""

    flat: Flattened
    state_keys: dict[str, str]


def rename_for_save(flat: Flattened, keys: KeyMap | None) -> Renamed:
    """``flat`` with every key renamed by ``keys``: a dict (keys it lacks keep their name) or a
    function from state key to saved key (None keeps the name). Raises
    :class:`CheckpointError` when two keys of the state get one saved key, or a saved key is
    not a non-empty string.

    >>> rename_for_save(flat, lambda k: k.removeprefix("model.")).flat.tensors  # doctest: +SKIP
    """
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

    out = dataclasses.replace(
        flat.renamed(new),
        reductions={new(k): r for k, r in flat.reductions.items()},
        numbered=[new(k) for k in flat.numbered],
    )
    return Renamed(out, {s: k for k, s in saved.items() if s != k})


@dataclasses.dataclass(frozen=True)
class StateKeys:
    """A load's ``keys`` given as a save's (state key -> saved key): the load renames its
    state's keys as the save did (a Checkpointer loads with the map it saves with)."""

    keys: KeyMap


def rename_to_saved(flat: Flattened, saved: Iterable[str], keys: KeyMap | StateKeys) -> Flattened:
    """A load's state under the saved keys: ``keys`` renames saved keys to the state's (see
    :func:`~unickpt.planning.load_keys.rename_for_load`), a :class:`StateKeys` the state's
    keys to the saved ones."""
    if isinstance(keys, StateKeys):
        return rename_for_save(flat, keys.keys).flat
    return rename_for_load(flat, saved, keys)
