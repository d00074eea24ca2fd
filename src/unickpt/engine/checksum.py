"""Content checksums: xxh3-64 over fixed-size segments of each stored chunk (a save's items
hashed on threads; a load's bytes checked against the index)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from ..errors import CheckpointCorruptError
from ..format.dtypes import buffer_of
from ..format.metadata import CHECKSUM_ALGORITHM, ChunkMeta

if TYPE_CHECKING:  # a load's checks import no torch (the CLI's inspect and verify)
    import torch

    from .sources import ItemSource

ALGORITHM = CHECKSUM_ALGORITHM

_HASH_PIECE_SEGMENTS = 64
"""Items are hashed in pieces of this many segments, each piece on a thread of its own."""


def digest(data: memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def segment_digests(data: memoryview, segment_bytes: int) -> list[str]:
    """Digests of ``data`` cut into ``segment_bytes`` pieces (the last may be shorter)."""
    n = len(data)
    return [digest(data[i : i + segment_bytes]) for i in range(0, n, segment_bytes)] or [
        digest(data)
    ]


def hash_items(
    sources: Sequence[ItemSource], nbytes: Sequence[int], segment: int, threads: int
) -> list[tuple[str, ...]]:
    """Every item's checksums (xxh3-64 per segment), hashed in pieces on ``threads`` threads."""
    step = segment * _HASH_PIECE_SEGMENTS
    tasks = [
        (i, start)
        for i, (src, n) in enumerate(zip(sources, nbytes))
        for start in (range(0, max(n, 1), step) if src.direct else (0,))
    ]

    def run(task: tuple[int, int]) -> tuple[str, ...]:
        i, start = task
        src = sources[i]
        data = src.contiguous_bytes()
        stop = start + step if src.direct else nbytes[i]
        return checksums_of(data[start:stop], segment)

    with ThreadPoolExecutor(threads, thread_name_prefix="unickpt-hash") as pool:
        pieces = list(pool.map(run, tasks))
    out: list[tuple[str, ...]] = [() for _ in sources]
    for (i, _), sums in zip(tasks, pieces):
        out[i] += sums
    return out


def checksums_of(data: torch.Tensor, segment: int) -> tuple[str, ...]:
    """The checksums of the bytes ``data`` (a uint8 tensor), one per ``segment`` bytes."""
    return tuple(segment_digests(buffer_of(data), segment))


@dataclass(frozen=True)
class ChunkRef:
    """A saved chunk and where it lies, as error messages name it."""

    key: str
    file: str
    chunk: ChunkMeta


def check_buffer(ref: ChunkRef, start: int, mv: memoryview, seg: int) -> None:
    """Raise CheckpointCorruptError unless every checksum segment of ``mv`` (bytes ``[start,
    start + len(mv))`` of the chunk, ``start`` segment-aligned) matches the chunk's index."""
    sums = ref.chunk.checksums
    for pos in range(0, len(mv), seg):
        index = (start + pos) // seg
        found = digest(mv[pos : pos + seg])
        expected = sums[index] if index < len(sums) else None
        if found != expected:
            lo = ref.chunk.byte_offset + start + pos
            hi = lo + min(seg, len(mv) - pos)
            raise CheckpointCorruptError(
                f"checksum mismatch in {ref.file} bytes [{lo}, {hi}) holding tensor "
                f"'{ref.key}' (chunk at offsets {list(ref.chunk.offsets)}): expected "
                f"{expected}, found {found}. The file is damaged; load an earlier checkpoint "
                "or pass verify=False to load it anyway."
            )
