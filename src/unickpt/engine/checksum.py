"""Content checksums: xxh3-64 over fixed-size segments of each stored chunk."""

from __future__ import annotations

import xxhash

from ..format.metadata import CHECKSUM_ALGORITHM

ALGORITHM = CHECKSUM_ALGORITHM


def digest(data: memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def segment_digests(data: memoryview, segment_bytes: int) -> list[str]:
    """Digests of ``data`` cut into ``segment_bytes`` pieces (the last may be shorter)."""
    n = len(data)
    return [digest(data[i : i + segment_bytes]) for i in range(0, n, segment_bytes)] or [
        digest(data)
    ]
