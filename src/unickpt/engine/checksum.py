"""Content checksums: xxh3-64 over fixed-size segments of each stored chunk."""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from ..errors import CheckpointCorruptError
from ..format.metadata import CHECKSUM_ALGORITHM, ChunkMeta

ALGORITHM = CHECKSUM_ALGORITHM


def digest(data: memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def segment_digests(data: memoryview, segment_bytes: int) -> list[str]:
    """Digests of ``data`` cut into ``segment_bytes`` pieces (the last may be shorter)."""
    n = len(data)
    return [digest(data[i : i + segment_bytes]) for i in range(0, n, segment_bytes)] or [
        digest(data)
    ]


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
