"""Where the pieces of a :class:`~unickpt.Fused` tensor lie in the global tensors they belong to.

A fused local tensor (SwiGLU's gate and up rows in one ``linear_fc1``, Q, K and V of each query
group in one ``linear_qkv``) is cut along its fused dimension into its pieces; each piece is a
box of its own global tensor ``{key}.{name}``. The views are of the local tensor, so a load
writes into it in place.
"""

from __future__ import annotations

import torch

from .boxes import Box
from .leaves import Fused

Pieces = list[tuple[Box, torch.Tensor]]


def fused_tensors(fused: Fused) -> dict[str, tuple[tuple[int, ...], Pieces]]:
    """For each global tensor named by a piece (in the order first named): its global shape
    and the boxes of it this rank holds, each with the view of ``fused.local`` holding it."""
    local = fused.local.detach()
    out: dict[str, tuple[tuple[int, ...], Pieces]] = {}
    start = 0
    for piece in fused.pieces:
        view = local.narrow(fused.dim, start, piece.length)
        start += piece.length
        _, pieces = out.setdefault(piece.name, (piece.global_shape, []))
        box = Box(piece.offsets, fused.piece_shape(piece))
        if box.numel:
            pieces.append((box, view))
    return out
