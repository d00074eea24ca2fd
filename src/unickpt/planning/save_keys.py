"""A load given the keys of a save (state key -> saved key), as a Checkpointer loads with the
map it saves with: the state's keys are renamed as the save renamed them
(:func:`~unickpt.planning.flatten.rename_for_save`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from .flatten import Flattened, KeyMap, rename_for_save
from .load_keys import rename_for_load


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
