"""The logical region of a padded tensor: each held box cut to the logical shape.

A :class:`~unickpt.Padded` leaf holds a tensor at a padded size (a vocabulary rounded up to a
multiple of the tensor-parallel size); only the part of each held box inside the logical shape
is saved or loaded, through a view of the held tensor, so the padding is never written and keeps
its values on load.
"""

from __future__ import annotations

import torch

from .boxes import Box


def clip_pieces(
    pieces: list[tuple[Box, torch.Tensor]], logical_shape: tuple[int, ...]
) -> list[tuple[Box, torch.Tensor]]:
    """The intersection of each held box (with its box-shaped view) with ``logical_shape``;
    boxes that lie wholly in the padding are left out."""
    logical = Box.whole(logical_shape)
    out = []
    for box, view in pieces:
        inside = box.intersect(logical)
        if inside is not None and inside.numel:
            out.append((inside, view[inside.relative_to(box)]))
    return out
