"""Replicated tensors at a save's plan: the copies of the ranks holding one compared, or averaged.

A :class:`~unickpt.Replicated` tensor (a LayerNorm weight every tensor-parallel rank holds) is
reduced across all ranks of the save, every rank taking part (ranks without the key give
nothing): ``reduce="check"`` takes the element-wise maximum and minimum of the copies' bit
patterns and fails the save on every rank where they differ in any bit (identical copies
holding infinities or NaNs pass), naming the key and the largest difference in value;
``reduce="mean"`` sums the copies and saves their mean. Every rank learns which keys are
replicated, with their shapes, from the save's own planning step, so no exchange is added to a
save without replicated tensors; one with them costs one all-reduce per kind of reduction, of
the replicated tensors' elements (as float64 for a mean, as int64 bit patterns for a check,
and a second, as float64, to name a difference found): each rank gives its copies, the
reductions run back to back, then every rank reads the same outcome from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..dist import Comm
from ..errors import CheckpointMismatchError
from ..format.dtypes import dtype_from_name, tensor_bytes
from ..planning.flatten import Flattened
from ..planning.local_plan import ReplicaSpec


@dataclass(frozen=True)
class _Agreed:
    spec: ReplicaSpec
    holders: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.spec.shape, dtype=np.int64))


def reduce_replicas(comm: Comm, flat: Flattened, specs: Sequence[tuple[ReplicaSpec, ...]]) -> None:
    """Check or average this save's replicated tensors; called by every rank with every rank's
    specs (the same on every rank, so every rank raises the same error, or none)."""
    agreed = _agree(specs)
    checks = [a for a in agreed if a.spec.reduce == "check"]
    means = [a for a in agreed if a.spec.reduce == "mean"]
    mine, inverted = _bits(flat, checks)
    copies = _values(flat, means, 0.0)
    both = comm.max_across(np.concatenate([mine, inverted])) if checks else mine
    total = comm.sum_across(copies) if means else copies
    if checks:
        _check(comm, flat, checks, both[: len(mine)] != ~both[len(mine) :])
    if means:
        _replace_by_means(flat, means, total)


def _agree(specs: Sequence[tuple[ReplicaSpec, ...]]) -> list[_Agreed]:
    """Every replicated key with its holders; the holders must describe it alike."""
    first: dict[str, tuple[ReplicaSpec, int]] = {}
    holders: dict[str, list[int]] = {}
    for rank, mine in enumerate(specs):
        for spec in mine:
            known, at = first.setdefault(spec.key, (spec, rank))
            if known != spec:
                raise CheckpointMismatchError(
                    f"Replicated '{spec.key}' is {_describe(spec)} on rank {rank} but "
                    f"{_describe(known)} on rank {at}; every rank holding a replicated tensor "
                    "must hold it with the same shape, dtype and reduce."
                )
            holders.setdefault(spec.key, []).append(rank)
    return [_Agreed(first[k][0], tuple(holders[k])) for k in sorted(first)]


def _describe(spec: ReplicaSpec) -> str:
    return f"{spec.dtype}{list(spec.shape)} with reduce={spec.reduce!r}"


def _values(flat: Flattened, agreed: list[_Agreed], fill: float) -> np.ndarray:
    """This rank's copies as float64, one after the other; ``fill`` where it holds none."""
    parts = []
    for a in agreed:
        leaf = flat.tensors.get(a.spec.key)
        if leaf is None or not leaf.pieces:
            parts.append(np.full(a.numel, fill, dtype=np.float64))
        else:
            ((_, view),) = leaf.pieces
            parts.append(view.detach().to("cpu", torch.float64).reshape(-1).numpy())
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)


def _check(comm: Comm, flat: Flattened, agreed: list[_Agreed], differ: np.ndarray) -> None:
    """Refuse the save where the copies of a key differ in any bit (``differ``, per word:
    its maximum over the holders is not its minimum, the max of ``~x`` being ``~min``);
    identical copies pass, infinities and NaNs included. Per key, the message names the largest
    difference in value among the elements that differ (a second reduction, run only then)."""
    if not differ.any():
        return
    x = _values(flat, agreed, -np.inf)
    extremes = comm.max_across(np.concatenate([x, -_values(flat, agreed, np.inf)]))
    with np.errstate(invalid="ignore"):
        spread = extremes[: len(x)] + extremes[len(x) :]  # max - min, element-wise
    bad = []
    words = values = 0
    for a in agreed:
        per = _words_per_element(a.spec.dtype)
        element_differs = differ[words : words + a.numel * per].reshape(a.numel, per).any(1)
        part = spread[values : values + a.numel]
        words, values = words + a.numel * per, values + a.numel
        if element_differs.any():
            ranked = np.where(element_differs, np.nan_to_num(part, nan=np.inf), -np.inf)
            where = int(np.argmax(ranked))
            bad.append((a, float(part[where]), where))
    raise CheckpointMismatchError(_differ_message(bad))


def _bits(flat: Flattened, agreed: list[_Agreed]) -> tuple[np.ndarray, np.ndarray]:
    """This rank's copies as the bit patterns of their elements (int64 words), and the same
    inverted, so that one max-reduction of both gives each word's maximum and minimum over the
    holders; a rank without a copy gives the lowest int64 in both, which changes neither."""
    low = np.iinfo(np.int64).min
    mine, inverted = [], []
    for a in agreed:
        leaf = flat.tensors.get(a.spec.key)
        if leaf is None or not leaf.pieces:
            none = np.full(a.numel * _words_per_element(a.spec.dtype), low, dtype=np.int64)
            mine.append(none)
            inverted.append(none)
        else:
            ((_, view),) = leaf.pieces
            raw = tensor_bytes(view.detach().cpu().contiguous())
            size = min(view.element_size(), 8)
            words = raw.view(f"<i{size}").astype(np.int64)
            mine.append(words)
            inverted.append(~words)
    empty = np.zeros(0, dtype=np.int64)
    return (np.concatenate(mine), np.concatenate(inverted)) if mine else (empty, empty)


def _words_per_element(dtype: str) -> int:
    """The int64 words of one element's bit pattern (two for 16-byte elements)."""
    return max(1, dtype_from_name(dtype).itemsize // 8)


def _differ_message(bad: list[tuple[_Agreed, float, int]]) -> str:
    shown = "; ".join(
        f"'{a.spec.key}' {_difference(diff)} between the copies of ranks "
        f"{_ranks(a.holders)} (at element {_element(at, a.spec.shape)})"
        for a, diff, at in bad[:5]
    )
    more = f" (and {len(bad) - 5} more keys)" if len(bad) > 5 else ""
    return (
        f"Replicated(reduce='check'): {shown}{more}. The ranks holding a "
        "replicated tensor must hold the same values; find why they diverged (gradients not "
        "reduced across tensor-parallel ranks), or use reduce='mean' to save their mean. "
        "Nothing was saved."
    )


def _difference(diff: float) -> str:
    if diff != diff:
        return "differs (a NaN, or an infinity, in some copies only)"
    if diff == 0:
        return (
            "differs in its bits, not as float64 values (0.0 and -0.0, NaNs of other bits, or "
            "integers beyond 2**53)"
        )
    return f"differs by up to {diff:g}"


def _element(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat_index, shape)) if shape else ()


def _ranks(ranks: tuple[int, ...]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (" ..." if len(ranks) > 8 else "")


def _replace_by_means(flat: Flattened, agreed: list[_Agreed], total: np.ndarray) -> None:
    """Replace this rank's copy of each key, for the save only, by the mean of all copies
    (``total``: their sum)."""
    start = 0
    for a in agreed:
        part = total[start : start + a.numel]
        start += a.numel
        leaf = flat.tensors.get(a.spec.key)
        if leaf is None or not leaf.pieces:
            continue
        ((box, view),) = leaf.pieces
        mean = torch.from_numpy(part / len(a.holders)).reshape(a.spec.shape)
        leaf.pieces = [(box, mean.to(view.dtype))]
