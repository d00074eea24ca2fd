"""Which keys of a checkpoint an export writes, and under which names.

A checkpoint's keys are dotted paths (``model.layers.0.weight``). ``only="model"`` keeps the
subtree under ``model.`` and strips that prefix, so the result is what
``model.load_state_dict`` takes. Exports that write a nested object group the dotted keys by
their first component (``{"model": {"layers.0.weight": ...}, "step": 7}``), the shape of the
usual ``{"model": model.state_dict(), ...}`` checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, CheckpointMismatchError
from ..format.metadata import Metadata


@dataclass(frozen=True)
class Selection:
    """Output name -> checkpoint key, for tensors and for values (objects and per-rank).

    ``aliases``: output name of a tied key -> output name of the tensor it is tied to (a tied
    key whose tensor lies outside the selection is an ordinary entry of ``tensors``).
    """

    tensors: dict[str, str]
    values: dict[str, str]
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.tensors and not self.values


def select_keys(meta: Metadata, only: str | None = None) -> Selection:
    """Every key, or the subtree ``only`` with its prefix removed."""
    value_keys = sorted(set(meta.objects) | set(meta.per_rank))
    if not only:
        return _with_aliases(
            meta, "", {k: k for k in sorted(meta.tensors)}, {k: k for k in value_keys}
        )
    prefix = only.rstrip(".") + "."
    tensors = {k[len(prefix) :]: k for k in sorted(meta.tensors) if k.startswith(prefix)}
    values = {k[len(prefix) :]: k for k in value_keys if k.startswith(prefix)}
    if not tensors and not values:
        leaf = only.rstrip(".")
        tops = sorted({k.split(".", 1)[0] for k in [*meta.tensors, *value_keys]})
        found = (
            f"'{leaf}' is a single entry, not a subtree"
            if leaf in meta.tensors or (leaf in value_keys)
            else f"no key starts with '{prefix}'"
        )
        raise CheckpointMismatchError(
            f"--only {only}: {found}; expected one of the checkpoint's top-level names: "
            f"{', '.join(tops[:20]) or '(none)'}. See `unickpt inspect` for every key."
        )
    return _with_aliases(meta, prefix, tensors, values)


def _with_aliases(
    meta: Metadata, prefix: str, tensors: dict[str, str], values: dict[str, str]
) -> Selection:
    aliases = {}
    for key, target in sorted(meta.aliases.items()):
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if target.startswith(prefix):
            aliases[name] = target[len(prefix) :]
        else:
            tensors[name] = key
    return Selection(tensors, values, aliases)


def nest_top_level(flat: dict[str, Any]) -> dict[str, Any]:
    """Group dotted keys by their first component: ``{"a.b.c": x} -> {"a": {"b.c": x}}``."""
    out: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        head, dot, rest = key.partition(".")
        if (head in out) != (head in groups) or (not dot and head in out):
            raise _clash(head)
        if not dot:
            out[head] = value
            continue
        group = groups.setdefault(head, {})
        out[head] = group
        group[rest] = value
    return out


def _clash(head: str) -> CheckpointError:
    return CheckpointError(
        f"'{head}' is both an entry and the prefix of other entries, so it cannot become one "
        f"key of a nested dict; export the subtrees one at a time with --only (only=...)."
    )
