"""The chunk map: where the chunks of every tensor are listed, without their byte offsets.

A reader that loads part of a checkpoint (one rank of many, a resharded load) needs the chunks
that overlap what it loads. They are listed in the index files of the ranks that wrote them;
without a map, every reader reads every index (thousands of files at thousands of ranks). The
map, in the global metadata (optional, format version 2), gives each tensor's chunk boxes and
the file whose index lists each; the reader finds the overlapping boxes on arrays and reads
only those indexes.

Tensors split alike (every layer's ``w1``) share one *layout*: one array of box coordinates and
one of file positions. On disk a layout is little-endian int64 rows (offsets, then lengths),
differences between consecutive rows, compressed with zlib and written as base64.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .limits import MAX_NDIM


@dataclass(frozen=True, eq=False)
class ChunkLayout:
    """Boxes of a tensor of ``ndim`` dimensions: ``coords`` (one int64 row per box: offsets,
    then lengths) and ``files`` (the position in ``Metadata.file_refs`` of the file whose
    index lists the box)."""

    ndim: int
    coords: np.ndarray
    files: np.ndarray

    def overlapping(self, offsets: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
        """A mask of the boxes that share an element with the box ``offsets``/``lengths``."""
        if not self.ndim:
            return np.ones(len(self.coords), dtype=bool)
        lo, n = self.coords[:, : self.ndim], self.coords[:, self.ndim :]
        want_lo = np.asarray(offsets, dtype=np.int64)
        want_hi = want_lo + np.asarray(lengths, dtype=np.int64)
        if (want_hi <= want_lo).any():
            return np.zeros(len(self.coords), dtype=bool)
        return ((lo < want_hi) & (lo + n > want_lo) & (n > 0)).all(axis=1)


@dataclass(frozen=True, eq=False)
class ChunkMap:
    """Each tensor's layout (a position in ``layouts``)."""

    tensors: dict[str, int]
    layouts: tuple[ChunkLayout, ...]

    def layout(self, key: str) -> ChunkLayout | None:
        found = self.tensors.get(key)
        return None if found is None else self.layouts[found]


def encode_chunk_map(chunk_map: ChunkMap) -> dict[str, Any]:
    """The map as it is stored in the global metadata's ``chunk_map``."""
    return {
        "layouts": [
            {
                "ndim": lay.ndim,
                "rows": len(lay.files),
                "coords": _pack(lay.coords),
                "files": _pack(lay.files.reshape(-1, 1)),
            }
            for lay in chunk_map.layouts
        ],
        "tensors": dict(chunk_map.tensors),
    }


def _sizes(doc: Any) -> list[tuple[int, int]]:
    """``(ndim, rows)`` of each layout of a ``chunk_map``, checked (nothing decoded)."""
    out = []
    for lay in doc["layouts"]:
        ndim, rows = int(lay["ndim"]), int(lay["rows"])
        if not 0 <= ndim <= MAX_NDIM or rows < 0:
            raise ValueError(f"a chunk map layout has {ndim} dimensions and {rows} rows")
        out.append((ndim, rows))
    return out


def chunk_map_rows(doc: Any) -> int:
    """The rows (boxes) the layouts of a ``chunk_map`` declare, before decoding them."""
    return sum(rows for _, rows in _sizes(doc))


def chunk_map_nbytes(doc: Any) -> int:
    """The bytes the layouts of a ``chunk_map`` declare they decode to."""
    return sum(rows * (2 * ndim + 1) * 8 for ndim, rows in _sizes(doc))


def decode_chunk_map(doc: Any) -> ChunkMap:
    """The map of a metadata's ``chunk_map``; raises ValueError where it is malformed. Each
    layout inflates to no more than the rows it declares (bound them first:
    :func:`chunk_map_rows`)."""
    layouts = []
    for lay, (ndim, rows) in zip(doc["layouts"], _sizes(doc)):
        coords = _unpack(str(lay["coords"]), rows, 2 * ndim)
        where = _unpack(str(lay["files"]), rows, 1).reshape(-1)
        layouts.append(ChunkLayout(ndim, coords, where))
    tensors = {str(k): int(v) for k, v in dict(doc["tensors"]).items()}
    if any(not 0 <= v < len(layouts) for v in tensors.values()):
        raise ValueError(f"a chunk map names a layout outside its {len(layouts)} layouts")
    return ChunkMap(tensors, tuple(layouts))


def _pack(rows: np.ndarray) -> str:
    deltas = np.diff(rows.astype("<i8"), axis=0, prepend=np.zeros((1, rows.shape[1]), "<i8"))
    return base64.b64encode(zlib.compress(deltas.astype("<i8").tobytes(), 6)).decode("ascii")


def _unpack(text: str, rows: int, width: int) -> np.ndarray:
    """The rows of a layout; inflating stops at the bytes ``rows`` and ``width`` declare."""
    expected = rows * width * 8
    inflate = zlib.decompressobj()
    packed = base64.b64decode(text.encode("ascii"), validate=True)
    raw = inflate.decompress(packed, max(expected, 1))  # 0 would mean no limit
    if len(raw) != expected or inflate.unconsumed_tail or not inflate.eof:
        raise ValueError(f"a chunk map layout holds more or fewer bytes than {rows}x{width}")
    deltas = np.frombuffer(raw, dtype="<i8").reshape(rows, width)
    return np.cumsum(deltas, axis=0, dtype=np.int64)
