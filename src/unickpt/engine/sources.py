"""Where the bytes of a data file come from: the tensors, a copy of them, or a staging ring.

An :class:`ItemSource` gives the bytes of one write item: a view of the tensor where it is
contiguous CPU memory (a snapshot's copy is), else a copy of the rows holding a range. A bounded
ring (:mod:`.ring`) instead copies each part's bytes ahead of its write; the writer
(:mod:`.data_file`) sees it as :class:`StagedParts` and knows nothing else of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..format.dtypes import byte_view
from .parts import Part


class ItemSource:
    """The bytes of one write item: a contiguous CPU tensor, or a view to copy from."""

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view
        self.direct = view.device.type == "cpu" and view.is_contiguous()

    def contiguous_bytes(self) -> torch.Tensor:
        t = self.view if self.direct else self.view.to("cpu").contiguous()
        return byte_view(t)

    def byte_range(self, start: int, nbytes: int, whole: bool) -> torch.Tensor:
        """Bytes ``[start, start + nbytes)`` of the source in row-major order. A source that
        is not contiguous CPU memory is copied: whole when ``whole`` (the item is one span),
        else only the rows that hold the range (pieces of a chunk cut under a part cap)."""
        if self.direct or whole:
            return self.contiguous_bytes()[start : start + nbytes]
        return span_bytes(self.view, start, nbytes, "cpu")


class StagedParts(Protocol):
    """The bytes of a data file's parts, staged ahead of their writes (a bounded ring)."""

    def part_bytes(self, target: int, segment: int) -> int:
        """The part size to plan the file with, given the writer's ``target``."""

    def start(self, parts: Sequence[Part]) -> None:
        """Start staging ``parts`` (the file's, in order)."""

    def buffers(self, part: Part) -> list[memoryview | None]:
        """The staged bytes of each span of ``part`` (None for padding); waits for them."""

    def release(self, part: Part) -> None:
        """``part`` is written: its room may be reused."""

    def stop(self) -> None:
        """Stop staging (the write ended or failed)."""


def span_bytes(
    view: torch.Tensor, start: int, nbytes: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Bytes ``[start, start + nbytes)`` of ``view`` in row-major order on ``device`` (default:
    the view's): a view where the tensor is contiguous there, else a copy of the rows that
    hold them."""
    device = view.device if device is None else torch.device(device)
    if view.is_contiguous() and view.device == device:
        return byte_view(view).reshape(-1)[start : start + nbytes]
    size = view.element_size()
    return byte_view(rows_copy(view, start // size, (start + nbytes) // size, device))


def rows_copy(
    view: torch.Tensor, first: int, end: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Elements ``[first, end)`` of ``view`` in row-major order, as a contiguous tensor on
    ``device``, copying only the leading-dimension rows that hold them (descending into a
    single row)."""
    if view.dim() <= 1:
        return view.reshape(-1)[first:end].to(device).contiguous()
    inner = max(1, view[0].numel())
    r0, r1 = first // inner, -(-end // inner)
    if r1 - r0 == 1:
        return rows_copy(view[r0], first - r0 * inner, end - r0 * inner, device)
    rows = view[r0:r1].to(device).contiguous().reshape(-1)
    return rows[first - r0 * inner : end - r0 * inner]


def needs_pinned(views: Sequence[torch.Tensor]) -> bool:
    """Whether copies of ``views`` go to pinned host memory (some are on a GPU)."""
    return any(v.device.type == "cuda" for v in views) and torch.cuda.is_available()
