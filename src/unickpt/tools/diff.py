"""Compare two checkpoints tensor by tensor (in row blocks) and value by value.

Tensors of equal shape are compared block by block: bitwise first, and where bits differ,
numerically in float64 (complex128 for complex dtypes), in NumPy: a diff imports no torch
(except to decode quantized tables). The relative difference of two
elements is ``|a - b| / max(|a|, |b|)``; NaN equals NaN; an element that is NaN on one side
only differs by infinity. Values are compared in their stored (JSON) encoding, which is exact.
"""

from __future__ import annotations

import difflib
import itertools
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..errors import UnsafeObjectError
from ..format.dtypes import itemsize_of
from ..format.values import decode_value
from ..storage.base import Storage
from .blocks import block_boxes
from .inspection import short_repr
from .numeric import widen
from .progress import ProgressFn
from .raw_reader import RawReader

MiB = 1 << 20
DEFAULT_BLOCK_BYTES = 32 * MiB
CONTEXT_CHARS = 24  # shown either side of the first character two values differ in
UNIFIED_LINES = 40  # at most, of the unified diff of two multi-line texts

TensorDiffKind = Literal["only_a", "only_b", "shape", "dtype", "values", "kind"]
ValueDiffKind = Literal["only_a", "only_b", "values"]


@dataclass(frozen=True)
class TensorDiff:
    """A tensor that differs. ``max_abs``/``max_rel``/``differing`` are set when the values
    were compared (same shape); ``differing`` counts elements whose bits differ."""

    key: str
    kind: TensorDiffKind
    dtype_a: str | None
    dtype_b: str | None
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    max_abs: float | None = None
    max_rel: float | None = None
    differing: int | None = None


@dataclass(frozen=True)
class ValueDiff:
    """A value that differs; ``a`` and ``b`` are short descriptions. Where both sides have
    a text (strings as they are, other values as their repr), ``offset`` is the first
    character that differs and ``context_a``/``context_b`` show it in a window
    (``...abc[X]def...``), so values whose short descriptions look alike (long strings, a
    Lightning state in one JSON string) show where they differ; ``unified`` is a unified diff
    of multi-line texts."""

    key: str
    kind: ValueDiffKind
    a: str | None
    b: str | None
    offset: int | None = None
    context_a: str | None = None
    context_b: str | None = None
    unified: str | None = None


@dataclass(frozen=True)
class DiffReport:
    """The outcome of :func:`diff_checkpoints`; ``identical`` when nothing differs."""

    a: str
    b: str
    tensors_compared: int
    values_compared: int
    bytes_compared: int
    tensors: tuple[TensorDiff, ...]
    values: tuple[ValueDiff, ...]
    elapsed_s: float

    @property
    def identical(self) -> bool:
        return not self.tensors and not self.values


def diff_checkpoints(
    a: str | os.PathLike[str] | Storage,
    b: str | os.PathLike[str] | Storage,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    verify: bool = True,
    progress: ProgressFn | None = None,
) -> DiffReport:
    """Compare checkpoints ``a`` and ``b``. With the default tolerances any bit differing
    counts; otherwise a tensor counts as equal when every element has
    ``|a - b| <= atol + rtol * |b|``. ``verify=False`` reads both without checking their
    checksums.

    >>> report = diff_checkpoints("ckpt/step-100", "ckpt/step-200")  # doctest: +SKIP
    >>> [(d.key, d.max_abs) for d in report.tensors]  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    with RawReader(a, verify=verify) as ra, RawReader(b, verify=verify) as rb:
        comparer = _TensorComparer(ra, rb, atol, rtol, block_bytes, progress)
        tensors = comparer.compare_all()
        values, nvalues = _compare_values(ra, rb)
    return DiffReport(
        ra.storage.location,
        rb.storage.location,
        comparer.compared,
        nvalues,
        comparer.done,
        tuple(tensors),
        tuple(values),
        time.perf_counter() - t0,
    )


class _TensorComparer:
    def __init__(
        self,
        ra: RawReader,
        rb: RawReader,
        atol: float,
        rtol: float,
        block_bytes: int,
        progress: ProgressFn | None,
    ) -> None:
        self.ra, self.rb = ra, rb
        self.atol, self.rtol = atol, rtol
        self.block_bytes = block_bytes
        self.progress = progress
        self.compared = 0
        self.done = 0
        self.total = 0

    def compare_all(self) -> list[TensorDiff]:
        ta, tb = self.ra.metadata.tensors, self.rb.metadata.tensors
        va = set(self.ra.metadata.objects) | set(self.ra.metadata.per_rank)
        vb = set(self.rb.metadata.objects) | set(self.rb.metadata.per_rank)
        both = sorted(set(ta) & set(tb))
        self.total = sum(self._nbytes(k) for k in both if ta[k].value_shape == tb[k].value_shape)
        out = []
        for key in sorted(set(ta) | set(tb)):
            if key in ta and key in tb:
                found = self.compare(key)
            elif key in ta:
                found = self._one_sided(key, "kind" if key in vb else "only_a")
            else:
                found = self._one_sided(key, "kind" if key in va else "only_b")
            if found is not None:
                out.append(found)
        return out

    def _nbytes(self, key: str) -> int:
        t = self.ra.metadata.tensors[key]
        return math.prod(t.value_shape) * itemsize_of(t.value_dtype)

    def _one_sided(self, key: str, kind: TensorDiffKind) -> TensorDiff:
        ma, mb = self.ra.metadata.tensors.get(key), self.rb.metadata.tensors.get(key)
        return TensorDiff(
            key,
            kind,
            ma.value_dtype if ma else None,
            mb.value_dtype if mb else None,
            tuple(ma.value_shape) if ma else None,
            tuple(mb.value_shape) if mb else None,
        )

    def compare(self, key: str) -> TensorDiff | None:
        ma, mb = self.ra.metadata.tensors[key], self.rb.metadata.tensors[key]
        self.compared += 1
        shapes = (tuple(ma.value_shape), tuple(mb.value_shape))
        if shapes[0] != shapes[1]:
            return TensorDiff(key, "shape", ma.value_dtype, mb.value_dtype, *shapes)
        stats = _Stats(ma.value_dtype, mb.value_dtype)
        size = max(itemsize_of(ma.value_dtype), itemsize_of(mb.value_dtype), 8)
        for box in block_boxes(ma.value_shape, size, self.block_bytes):
            xa = self.ra.read_box(key, box)
            xb = self.rb.read_box(key, box)
            stats.add(xa, xb, self.atol, self.rtol)
            self.done += xa.nbytes
            del xa, xb  # before the next blocks are read
            if self.progress is not None:
                self.progress(self.done, self.total)
        if ma.value_dtype == mb.value_dtype and not stats.beyond_tolerance:
            return None
        kind: TensorDiffKind = "values" if ma.value_dtype == mb.value_dtype else "dtype"
        return TensorDiff(
            key,
            kind,
            ma.value_dtype,
            mb.value_dtype,
            *shapes,
            stats.max_abs,
            stats.max_rel,
            stats.differing,
        )


class _Stats:
    """Running maxima of the differences of one tensor over its blocks (raw bytes of dtypes
    ``dtype_a`` and ``dtype_b``)."""

    def __init__(self, dtype_a: str, dtype_b: str) -> None:
        self.dtype_a, self.dtype_b = dtype_a, dtype_b
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.differing = 0
        self.beyond_tolerance = False

    def add(self, a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> None:
        same_dtype = self.dtype_a == self.dtype_b
        if same_dtype and np.array_equal(a, b):
            return
        count = math.prod(a.shape[:-1])
        self.differing += int((a != b).any(axis=-1).sum()) if same_dtype else count
        x, y = widen(a, self.dtype_a), widen(b, self.dtype_b)
        if x is None or y is None:
            self.beyond_tolerance = True
            self.max_abs = self.max_rel = math.nan
            return
        with np.errstate(all="ignore"):
            diff, scale = _abs_diff(x.reshape(-1), y.reshape(-1))
            rel = np.nan_to_num(np.where(diff == 0, 0.0, diff / scale), nan=math.inf)
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.max_rel = max(self.max_rel, float(rel.max()))
            exact = atol == 0 and rtol == 0
            if exact or bool((diff > atol + rtol * np.abs(y.reshape(-1))).any()):
                self.beyond_tolerance = True


def _abs_diff(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Element-wise ``|x - y|`` (0 where equal, NaN on both sides included; inf where one side
    is NaN) and ``max(|x|, |y|)``."""
    same = (x == y) | (np.isnan(x) & np.isnan(y))
    diff = np.nan_to_num(np.where(same, 0.0, np.abs(x - y)), nan=math.inf)
    return diff, np.maximum(np.abs(x), np.abs(y))


def _compare_values(ra: RawReader, rb: RawReader) -> tuple[list[ValueDiff], int]:
    ea, eb = _encoded_values(ra), _encoded_values(rb)
    ta, tb = ra.metadata.tensors, rb.metadata.tensors
    out = []
    compared = 0
    for key in sorted(set(ea) | set(eb)):
        if key in ea and key in eb:
            compared += 1
            if ea[key] != eb[key]:
                where = locate_difference(_text(ra, key), _text(rb, key))
                out.append(ValueDiff(key, "values", _show(ra, key), _show(rb, key), *where))
        elif key in ea and key not in tb:
            out.append(ValueDiff(key, "only_a", _show(ra, key), None))
        elif key in eb and key not in ta:
            out.append(ValueDiff(key, "only_b", None, _show(rb, key)))
    return out, compared


def _encoded_values(reader: RawReader) -> dict[str, Any]:
    meta = reader.metadata
    return {**meta.objects, **{k: list(v) for k, v in meta.per_rank.items()}}


def _text(reader: RawReader, key: str) -> str | None:
    """The full text of a value (a string as it is, anything else as its repr); None when it
    was saved with pickle or no rank saved it."""
    meta = reader.metadata
    if key in meta.objects:
        encoded = meta.objects[key]
    else:
        first = meta.first_per_rank(key)
        if first is None:
            return None
        encoded = first[1]
    try:
        value = decode_value(encoded, key, allow_pickle=False, stored=True)
    except UnsafeObjectError:
        return None
    return value if isinstance(value, str) else repr(value)


def locate_difference(
    a: str | None, b: str | None, context: int = CONTEXT_CHARS
) -> tuple[int | None, str | None, str | None, str | None]:
    """``(offset, context_a, context_b, unified)`` for two texts that differ: the first
    differing character, a window of ``context`` characters either side of it on each side
    (``...abc[X]def...``, ``[]`` past a text's end), and a unified diff when both texts span
    several lines (at most :data:`UNIFIED_LINES` lines). All None when a text is missing.

    >>> locate_difference("step=10,lr=0.1", "step=10,lr=0.2", context=4)
    (13, '...lr=0.[1]', '...lr=0.[2]', None)
    """
    if a is None or b is None or a == b:
        return None, None, None, None
    offset = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    unified = None
    if a.count("\n") >= 2 and b.count("\n") >= 2:
        lines = difflib.unified_diff(a.splitlines(), b.splitlines(), "A", "B", n=2, lineterm="")
        shown = list(itertools.islice(lines, UNIFIED_LINES + 1))
        if len(shown) > UNIFIED_LINES:
            shown[-1] = "..."
        unified = "\n".join(shown)
    return offset, _window(a, offset, context), _window(b, offset, context), unified


def _window(text: str, offset: int, context: int) -> str:
    lo, hi = max(0, offset - context), min(len(text), offset + 1 + context)
    parts = [
        "..." if lo > 0 else "",
        _escape(text[lo:offset]),
        f"[{_escape(text[offset : offset + 1])}]",
        _escape(text[offset + 1 : hi]),
        "..." if hi < len(text) else "",
    ]
    return "".join(parts)


def _escape(text: str) -> str:
    """Control characters (newlines, tabs) escaped, so a window stays on one line."""
    return text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text


def _show(reader: RawReader, key: str) -> str:
    meta = reader.metadata
    rank = None
    if key in meta.objects:
        encoded = meta.objects[key]
    else:
        first = meta.first_per_rank(key)
        if first is None:
            return "<no rank's value>"
        rank, encoded = first
    try:
        text = short_repr(decode_value(encoded, key, allow_pickle=False, stored=True))
    except UnsafeObjectError:
        return "<saved with pickle>"
    return f"{text} (rank {rank})" if rank is not None else text
