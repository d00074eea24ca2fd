"""Which keys a load reads: each rank's state against the checkpoint, then across ranks.

Ranks may hold different keys (pipeline stages, experts): each rank asks only for the keys of its
own state, and ``strict`` holds per rank (every key it asks for exists, as the same kind of leaf
with the same shape and dtype). A saved key that *no* rank asks for, under a top-level key being
loaded, is found without exchanging key lists: each rank marks the saved keys it asks for in a
bitmap over the sorted saved keys, and the bitmaps are combined with one ``all_reduce(MAX)``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointMismatchError
from ..format.dtypes import dtype_from_name, dtype_name, itemsize
from ..format.metadata import Metadata
from ..units import format_bytes
from .flatten import Flattened, KeyMap, memory_span, rename_for_save

NUMBERED_HINT = (
    "{prefixes} {holds} an optimizer state dict keyed by parameter number "
    "(optimizer.state_dict()), which loads only into the same layout; put the optimizer object "
    "itself in the state ({{'optim': optimizer}}) so its state is keyed by parameter name and "
    "reshards."
)


@dataclass(frozen=True)
class Difference:
    """How a key of the state differs from the checkpoint: ``what`` is ``kind``, ``shape`` or
    ``dtype``; ``saved`` the saved dtype (for ``dtype``)."""

    what: str
    sentence: str
    saved: str = ""


@dataclass(frozen=True)
class KeyMatch:
    """This rank's state against the checkpoint.

    ``missing``: keys of the state the checkpoint lacks; ``differ``: keys of both whose leaves
    differ, with what differs (``kind``, ``shape`` or ``dtype``) and how; both keep their current
    values.
    ``resolved``: each tensor key of the state to the stored key it reads (itself, or the key it
    is tied to in the checkpoint). A further key of a tensor the state holds twice (tied
    weights: ``lm_head.weight`` sharing ``wte.weight``'s memory) is loaded with the tensor and
    is never missing, whether or not the checkpoint stores it (``save_pretrained`` omits it).
    """

    missing: tuple[str, ...]
    differ: dict[str, Difference]
    resolved: dict[str, str] = field(default_factory=dict)

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(sorted({*self.missing, *self.differ}))


def match_keys(meta: Metadata, flat: Flattened, strict: bool) -> KeyMatch:
    """Check this rank's state against the checkpoint; raise when ``strict`` and they differ."""
    saved = meta.keys()
    differ: dict[str, Difference] = {}
    resolved: dict[str, str] = {}
    names: dict[str, list[str]] = {}
    for alias, target in flat.aliases.items():
        names.setdefault(target, []).append(alias)
    for key, leaf in flat.tensors.items():
        stored = _stored_tensor(meta, [key, *names.get(key, ())])
        if stored is None:
            if key in saved:
                differ[key] = Difference(
                    "kind", f"'{key}' is a tensor in the state but {_in(meta, key)}"
                )
            continue
        resolved[key] = stored
        # a quantized table is compared by the values it decodes to, not by its stored codes
        t = meta.tensors[stored]
        shape, dtype = t.value_shape, t.value_dtype
        if tuple(shape) != leaf.shape:
            differ[key] = Difference(
                "shape",
                f"'{key}' has global shape {list(shape)} in the checkpoint but "
                f"{list(leaf.shape)} in the state",
            )
        elif dtype != dtype_name(leaf.dtype):
            differ[key] = Difference(
                "dtype",
                f"'{key}' is {dtype} in the checkpoint but {dtype_name(leaf.dtype)} in the state",
                dtype,
            )
    for key in flat.values:
        if key in saved and key not in meta.objects:
            differ[key] = Difference(
                "kind", f"'{key}' is a plain value in the state but {_in(meta, key)}"
            )
    for key in flat.per_rank:
        if key in saved and key not in meta.per_rank:
            differ[key] = Difference(
                "kind", f"'{key}' is a PerRank value in the state but {_in(meta, key)}"
            )
    loaded = {k for k in resolved if k not in differ}
    within = within_loaded(flat, loaded)
    missing = sorted(
        k
        for k in flat.keys() - saved
        if k not in resolved and flat.aliases.get(k) not in loaded and k not in within
    )
    if strict and (missing or differ):
        raise CheckpointMismatchError(_mismatch_message(missing, differ, flat.numbered))
    return KeyMatch(tuple(missing), differ, resolved)


def within_loaded(flat: Flattened, loaded: set[str]) -> set[str]:
    """Tensor keys of the state whose memory lies wholly inside that of a tensor the load
    fills (a view of a loaded tensor: the load fills it too). Only contiguous loaded tensors
    count: their memory is all theirs, every byte of their span written."""
    candidates = [k for k, leaf in flat.tensors.items() if k not in loaded and leaf.pieces]
    if not candidates:  # the usual load: nothing to look for
        return set()
    spans: list[tuple[str, int, int]] = []
    for key in loaded:
        for _, t in flat.tensors[key].pieces:
            span = memory_span(t) if t.is_contiguous() else None
            if span is not None:
                spans.append(span)
    if not spans:
        return set()
    spans.sort()
    return {
        k
        for k in candidates
        if all(_inside(memory_span(t), spans) for _, t in flat.tensors[k].pieces)
    }


def _inside(span: tuple[str, int, int] | None, spans: list[tuple[str, int, int]]) -> bool:
    """Whether ``span`` lies within one of ``spans`` (sorted by device, then start)."""
    if span is None:
        return False
    device, start, end = span
    i = bisect.bisect_right(spans, (device, start, math.inf))
    return any(d == device and s <= start and end <= e for d, s, e in spans[:i])


def rename_for_load(flat: Flattened, saved: Iterable[str], keys: KeyMap) -> Flattened:
    """``flat`` with each state key that ``keys`` gives to a saved key renamed to that saved
    key, so the load matches it there (errors and reports then name the saved key). Raise when
    two saved keys map to one state key."""
    to_saved: dict[str, str] = {}
    for name in sorted(saved):
        target = keys.get(name) if isinstance(keys, Mapping) else keys(name)
        if target is None or target == name:
            continue
        if target in to_saved:
            raise CheckpointMismatchError(
                f"keys= maps both '{to_saved[target]}' and '{name}' of the checkpoint to "
                f"'{target}' of the state; expected one saved key per state key. Fix the mapping."
            )
        to_saved[target] = name
    return flat.renamed(lambda key: to_saved.get(key, key))


def _stored_tensor(meta: Metadata, names: list[str]) -> str | None:
    """The stored tensor a state tensor (known by ``names``: its key, then the further keys of
    tied weights) reads: a stored tensor of one of its names, or the one a name is tied to."""
    for name in names:
        if name in meta.tensors:
            return name
        if name in meta.aliases:
            return meta.aliases[name]
    return None


def _in(meta: Metadata, key: str) -> str:
    if meta.tensor(key) is not None:
        return "a tensor in the checkpoint"
    kind = "a PerRank value" if key in meta.per_rank else "a plain value"
    return kind + " in the checkpoint"


_ADVICE = {
    "shape": "build the model with the saved configuration (unickpt reshards layouts, not sizes)",
    "dtype": "create the state with dtype {dtypes} (and cast after loading if needed)",
    "kind": "put a leaf of the saved kind there, or check that this is the right checkpoint",
}


def _mismatch_message(
    missing: list[str], differ: dict[str, Difference], numbered: list[str]
) -> str:
    parts = []
    if missing:
        parts.append(f"the state has keys the checkpoint lacks: {few(missing)}")
    if differ:
        shown = [d.sentence for _, d in sorted(differ.items())[:5]]
        more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
        parts.append("; ".join(shown) + more)
        dtypes = ", ".join(sorted({d.saved for d in differ.values() if d.what == "dtype"}))
        whats = sorted({d.what for d in differ.values()})
        parts.append("; ".join(_ADVICE[w].format(dtypes=dtypes) for w in whats))
    hint = numbered_hint([*missing, *differ], numbered)
    return (
        "; ".join(parts)
        + ". "
        + (hint + " " if hint else "")
        + "Pass strict=False to load the keys both have (the others keep their current values), "
        "or load into a state with the saved structure."
    )


def numbered_hint(keys: Iterable[str], numbered: list[str]) -> str:
    """Advice when some of ``keys`` lie under optimizer state dicts keyed by number."""
    hit = sorted({p for p in numbered for k in keys if k == p or k.startswith(p + ".")})
    if not hit:
        return ""
    names = ", ".join(f"'{p}'" for p in hit)
    return NUMBERED_HINT.format(prefixes=names, holds="holds" if len(hit) == 1 else "hold")


@dataclass(frozen=True)
class SavedKeys:
    """The saved keys in a fixed order, and their top-level keys: the bitmap's positions."""

    keys: tuple[str, ...]
    tops: tuple[str, ...]

    @staticmethod
    def of(meta: Metadata) -> SavedKeys:
        keys = tuple(sorted(meta.keys()))
        return SavedKeys(keys, tuple(sorted({top_of(k) for k in keys})))

    def asked(self, flat: Flattened, match: KeyMatch) -> np.ndarray:
        """1 for each saved key this rank asks for (or reads for a tied key), then 1 for each
        top-level key its state has."""
        names = flat.keys()
        wanted = names | set(match.resolved.values())
        tops = {top_of(k) for k in names}
        bits = [k in wanted for k in self.keys] + [t in tops for t in self.tops]
        return np.array(bits, dtype=np.uint8)

    def unread(self, asked_anywhere: np.ndarray) -> list[str]:
        """Saved keys no rank asked for, under top-level keys some rank loads."""
        n = len(self.keys)
        loaded = {t for t, bit in zip(self.tops, asked_anywhere[n:]) if bit}
        bits = asked_anywhere[:n]
        return [k for k, bit in zip(self.keys, bits) if not bit and top_of(k) in loaded]


def top_of(key: str) -> str:
    return key.split(".", 1)[0]


def unread_message(meta: Metadata, unread: list[str], numbered: list[str], world: int) -> str:
    hint = numbered_hint(unread, numbered)
    if world == 1:
        return (
            f"the checkpoint has keys the state lacks: {few(unread)} "
            f"({summarize(meta, unread)}). "
            + (hint + " " if hint else "")
            + "Pass strict=False to load the keys both have, or load into a state with the "
            "saved structure."
        )
    return (
        f"the checkpoint has keys that no rank's state asks for: {few(unread)} "
        f"({summarize(meta, unread)}). "
        + (hint + " " if hint else "")
        + "Pass strict=False to load the keys the states have, or load into states with the "
        "saved structure (across all ranks, every saved key under a loaded top-level key must be "
        "asked for by some rank)."
    )


def summarize(meta: Metadata, keys: Iterable[str]) -> str:
    """``3 tensors (1.5 MiB), 1 value`` for saved keys."""
    tensors = values = nbytes = 0
    for k in keys:
        t = meta.tensor(k)
        if t is None:
            values += 1
        else:
            tensors += 1
            nbytes += math.prod(t.shape) * itemsize(dtype_from_name(t.dtype))
    parts = []
    if tensors:
        parts.append(f"{tensors} tensor{'s' * (tensors != 1)} ({format_bytes(nbytes)})")
    if values:
        parts.append(f"{values} value{'s' * (values != 1)}")
    return ", ".join(parts) or "nothing"


def not_loaded_warning(
    meta: Metadata, unread: list[str], match: KeyMatch, world: int
) -> str | None:
    """The strict=False warning: per top-level key, what was saved and not loaded, and why."""
    reasons: dict[str, dict[str, list[str]]] = {}
    absent = "not in the state" if world == 1 else "not in any rank's state"
    for k in unread:
        reasons.setdefault(top_of(k), {}).setdefault(absent, []).append(k)
    for k, d in match.differ.items():
        stored = match.resolved.get(k, k)
        reasons.setdefault(top_of(k), {}).setdefault(f"{d.what} differs", []).append(stored)
    lines = []
    for top in sorted(reasons):
        for why, keys in sorted(reasons[top].items()):
            lines.append(f"'{top}': {summarize(meta, keys)} not loaded ({why}): {few(keys, 3)}")
    if match.missing:
        n = len(match.missing)
        lines.append(
            f"{n} key{'s' * (n != 1)} of this rank's state {'are' if n != 1 else 'is'} not in "
            f"the checkpoint and keep{'s' * (n == 1)} {'their' if n != 1 else 'its'} current "
            f"value{'s' * (n != 1)}: {few(list(match.missing), 3)}"
        )
    if not lines:
        return None
    return "strict=False: " + "; ".join(lines)


def few(keys: list[str], n: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")


@dataclass(frozen=True)
class StateKeys:
    """A load's ``keys`` given as a save's (state key -> saved key): the load renames its
    state's keys as the save did (a Checkpointer loads with the map it saves with)."""

    keys: KeyMap


def rename_to_saved(flat: Flattened, saved: Iterable[str], keys: KeyMap | StateKeys) -> Flattened:
    """A load's state under the saved keys: ``keys`` renames saved keys to the state's (see
    :func:`rename_for_load`), a :class:`StateKeys` the state's keys to the saved ones (as
    :func:`~unickpt.planning.flatten.rename_for_save` renamed them)."""
    if isinstance(keys, StateKeys):
        return rename_for_save(flat, keys.keys).flat
    return rename_for_load(flat, saved, keys)
