"""Matching destination boxes against saved chunks: the same answer for few chunks and many."""

from __future__ import annotations

import random

import pytest

from unickpt.format.metadata import ChunkMeta
from unickpt.layouts.boxes import Box
from unickpt.planning.load_plan import ChunkIndex


def _grid(rows: list[int], cols: list[int]) -> list[ChunkMeta]:
    """Chunks tiling a matrix by the row and column cuts given (some zero-length)."""
    out = []
    r0 = 0
    for r in rows:
        c0 = 0
        for c in cols:
            out.append(ChunkMeta((r0, c0), (r, c), len(out), 0, r * c * 4, ()))
            c0 += c
        r0 += r
    return out


@pytest.mark.parametrize("seed", range(6))
def test_overlapping_chunks_and_their_overlaps_for_any_number_of_chunks(seed: int) -> None:
    rng = random.Random(seed)
    rows = [rng.choice([0, 1, 3, 5]) for _ in range(rng.randint(1, 6))]
    cols = [rng.choice([0, 2, 4]) for _ in range(rng.randint(1, 5))]
    chunks = _grid(rows, cols)
    rng.shuffle(chunks)
    index = ChunkIndex(chunks)
    assert index.few == (len(chunks) <= 8)
    shape = (sum(rows), sum(cols))
    for _ in range(40):
        o = tuple(rng.randint(0, max(0, n - 1)) for n in shape)
        box = Box(o, tuple(rng.randint(0, n - a) for a, n in zip(o, shape)))
        found = sorted((c.file, ov) for c, ov in index.overlapping(box))
        expected = sorted((c.file, ov) for c in chunks if (ov := c.box.intersect(box)) is not None)
        assert found == expected
    assert sorted(c.file for c in index.chunks) == sorted(c.file for c in chunks)
