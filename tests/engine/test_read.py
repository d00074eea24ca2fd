"""The read path: pieces cut on the checksum segments of the checkpoint being read."""

from __future__ import annotations

from pathlib import Path

import torch

import unickpt
from unickpt.config import MiB, get_config
from unickpt.engine.read import aligned_piece_bytes


def test_pieces_are_whole_segments_of_the_checkpoint() -> None:
    assert aligned_piece_bytes(64 * MiB, 1 * MiB) == 64 * MiB
    assert aligned_piece_bytes(64 * MiB, 3 * MiB) == 63 * MiB
    assert aligned_piece_bytes(64 * MiB, 96 * MiB) == 96 * MiB  # never less than a segment
    assert aligned_piece_bytes(65536, 12288) == 61440


def test_a_checkpoint_with_other_segments_loads_with_the_default_config(tmp_path: Path) -> None:
    """3 MiB segments do not divide the reader's 64 MiB pieces; a chunk of 70 MiB spans two."""
    writer = get_config(segment_bytes=3 * MiB, window_bytes=63 * MiB, read_piece_bytes=63 * MiB)
    big = torch.randint(-(2**31), 2**31 - 1, (70 * MiB // 4,), dtype=torch.int32)
    state = {"big": big, "small": torch.arange(10.0)}
    unickpt.save(tmp_path / "c", state, config=writer)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    unickpt.load(tmp_path / "c", dest)  # the default config: 64 MiB pieces, verified
    assert torch.equal(dest["big"], big) and torch.equal(dest["small"], state["small"])
    # A region of the chunk (another layout): read through a buffer, segment by segment.
    start, n = 3 * MiB // 4 + 5, 16 * MiB // 4
    part = unickpt.ShardedTensor(torch.zeros(n, dtype=torch.int32), big.shape, (start,))
    unickpt.load(tmp_path / "c", {"big": part})
    assert torch.equal(part.local, big[start : start + n])
