"""Lossless compression of chunks: per checksum segment, bytes grouped, then zstd.

A compressed chunk is stored as its segments (``segment_bytes`` of raw bytes each, the last
possibly shorter) one after the other, each compressed on its own, so a read of part of a chunk
reads and decodes only the segments that hold it. A segment is compressed by grouping the bytes
of its elements (all first bytes, then all second bytes, ...: for bf16 and fp32 the exponent
bytes apart from the mantissa bytes), then one zstd frame of the grouped bytes. A segment that
does not shrink by at least ``MIN_GAIN`` is stored raw (its stored size equals its raw size); a
chunk none of whose segments shrinks is stored plainly, without compression in its index entry.
Checksums cover the stored bytes of each segment, so damage is found before decoding.

Runs in the compressing threads, one segment per task (zstd releases the GIL); decoding in
the reader threads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError, CheckpointError
from ..format.metadata import COMPRESSION_CODEC, ChunkMeta, Compression
from ..storage.base import Storage
from .checksum import digest

CODEC = COMPRESSION_CODEC
LEVEL = 1
MIN_GAIN = 0.03
"""A segment is stored compressed only when that saves at least this fraction of its bytes."""

_local = threading.local()


def _zstd() -> object:
    try:
        import zstandard
    except ImportError as e:
        raise CheckpointError(
            "compress=True needs the zstandard package, which is not installed; install it "
            "(pip install 'unickpt[compress]' or pip install zstandard) or save with "
            "compress=False."
        ) from e
    return zstandard


def check_available() -> None:
    """Raise a :class:`CheckpointError` saying what to install when the codec is missing."""
    _zstd()


def _compressor(level: int) -> object:
    found = getattr(_local, "compressors", None)
    if found is None:
        found = _local.compressors = {}
    c = found.get(level)
    if c is None:
        c = found[level] = _zstd().ZstdCompressor(level=level)  # type: ignore[attr-defined]
    return c


def _decompressor() -> object:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = _zstd().ZstdDecompressor()  # type: ignore[attr-defined]
    return d


_WORDS: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def group_bytes(raw: np.ndarray, width: int) -> np.ndarray:
    """The bytes of ``width``-byte elements as planes: byte 0 of every element, then byte 1..."""
    if width <= 1 or len(raw) % width:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, width).T).reshape(-1)  # a gathering copy


def ungroup_bytes(planes: np.ndarray, width: int) -> np.ndarray:
    """The inverse of :func:`group_bytes`."""
    if width <= 1 or len(planes) % width:
        return planes
    word = _WORDS.get(width)
    if word is None:
        return np.ascontiguousarray(planes.reshape(width, -1).T).reshape(-1)
    n = len(planes) // width
    words = planes[:n].astype(word)
    for j in range(1, width):  # a scattered byte copy is several times slower
        words |= np.left_shift(planes[j * n : (j + 1) * n].astype(word), 8 * j)
    return words.view(np.uint8)


def encode_unit(raw: bytes | memoryview | np.ndarray, width: int, level: int = LEVEL) -> bytes:
    """One segment's stored form when compressed: a zstd frame of its grouped bytes."""
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    out: bytes = _compressor(level).compress(group_bytes(data, width))  # type: ignore[attr-defined]
    return out


def decode_unit(stored: bytes | memoryview | np.ndarray, nbytes: int, width: int) -> np.ndarray:
    """The ``nbytes`` raw bytes of a compressed segment. Raises ``ValueError`` when the frame
    does not decode to exactly ``nbytes`` bytes."""
    zstd = _zstd()
    try:
        planes = _decompressor().decompress(stored, max_output_size=nbytes)  # type: ignore[attr-defined]
    except zstd.ZstdError as e:  # type: ignore[attr-defined]
        raise ValueError(f"the zstd frame does not decode ({e})") from e
    if len(planes) != nbytes:
        raise ValueError(f"the zstd frame decodes to {len(planes)} bytes, expected {nbytes}")
    return ungroup_bytes(np.frombuffer(planes, dtype=np.uint8), width)


@dataclass(frozen=True)
class Packed:
    """A chunk's stored bytes, their checksums (per stored segment), and how it is compressed
    (None: stored plainly, ``data`` is then the raw bytes)."""

    data: np.ndarray
    checksums: tuple[str, ...]
    compression: Compression | None
    raw_checksums: tuple[str, ...] = ()
    """The checksums of the raw bytes of a compressed chunk (per segment)."""


@dataclass(frozen=True)
class Segment:
    """One segment's stored bytes (a zstd frame, or a view of its raw bytes where that does
    not pay), their checksum, and the checksum of its raw bytes (the same when stored raw)."""

    stored: np.ndarray
    checksum: str
    raw_checksum: str
    raw_nbytes: int

    @property
    def shrunk(self) -> bool:
        return len(self.stored) < self.raw_nbytes


def pack_segment(piece: np.ndarray, width: int, level: int = LEVEL) -> Segment:
    """The stored form of one segment's raw bytes: compressed where that saves at least
    :data:`MIN_GAIN` (``width`` 0: never, only hashed)."""
    stored = piece
    if width and len(piece):
        packed = encode_unit(piece, width, level)
        if len(packed) <= len(piece) * (1 - MIN_GAIN):
            stored = np.frombuffer(packed, dtype=np.uint8)
    found = digest(memoryview(stored))  # type: ignore[arg-type]
    raw = found if stored is piece else digest(memoryview(piece))  # type: ignore[arg-type]
    return Segment(stored, found, raw, len(piece))


def segment_starts(nbytes: int, segment: int) -> range:
    """Where a chunk's segments start (an empty chunk is one empty segment)."""
    return range(0, nbytes, segment) if nbytes else range(1)


def chunk_entry(segments: Sequence[Segment], width: int) -> Packed:
    """A chunk's :class:`Packed` from its segments, in order (``data`` left empty: the stored
    bytes are the segments'). Stored plainly when no segment shrinks."""
    sums = tuple(s.checksum for s in segments)
    empty = np.empty(0, dtype=np.uint8)
    if not width or not any(s.shrunk for s in segments):
        return Packed(empty, sums, None)
    sizes = tuple(len(s.stored) for s in segments)
    raw_sums = tuple(s.raw_checksum for s in segments)
    return Packed(empty, sums, Compression(CODEC, width, sizes), raw_sums)


def pack(raw: np.ndarray, width: int, segment: int, level: int = LEVEL) -> Packed:
    """The stored form of a chunk's raw bytes: each segment compressed where that pays
    (``width`` 0: none is, the chunk is stored plainly)."""
    pieces = [
        pack_segment(raw[a : a + segment], width, level) for a in segment_starts(len(raw), segment)
    ]
    entry = chunk_entry(pieces, width)
    data = np.concatenate([p.stored for p in pieces]) if entry.compression else raw
    return replace(entry, data=data)


def stored_offsets(c: Compression) -> list[int]:
    """Where each stored segment starts in the stored chunk, and the stored chunk's end."""
    return [0, *np.cumsum(c.stored, dtype=np.int64).tolist()]


def segment_range(start: int, stop: int, segment: int) -> range:
    """The segments holding raw chunk bytes ``[start, stop)``."""
    return range(start // segment, max(start // segment + 1, -(-stop // segment)))


def unpack_segments(
    stored: np.ndarray,
    c: Compression,
    first: int,
    raw_nbytes: int,
    segment: int,
    where: str,
) -> np.ndarray:
    """The raw bytes of segments ``first, first + 1, ...`` from their stored bytes ``stored``
    (consecutive, starting at segment ``first``). ``where`` names the chunk in errors."""
    out = []
    at = 0
    index = first
    while at < len(stored):
        size = c.stored[index]
        raw = min(segment, raw_nbytes - index * segment)
        piece = stored[at : at + size]
        if size == raw:
            out.append(piece)
        else:
            try:
                out.append(decode_unit(piece, raw, c.width))
            except ValueError as e:
                raise CheckpointCorruptError(
                    f"{where}: compressed segment {index} ({size} stored bytes, {raw} raw) does "
                    f"not decode: {e}. The file is damaged; load an earlier checkpoint."
                ) from e
        at += size
        index += 1
    return np.concatenate(out) if len(out) != 1 else out[0]


def read_packed(
    storage: Storage,
    file: str,
    key: str,
    chunk: ChunkMeta,
    start: int,
    out: np.ndarray,
    verify: bool,
    segment: int,
) -> None:
    """Raw bytes ``[start, start + len(out))`` of compressed ``chunk`` into ``out``: one read
    of the stored segments that hold them, each checked against its checksum (``verify``)
    before it is decoded."""
    lo, hi = packed_span(chunk, start, start + len(out), segment)
    stored = np.empty(hi - lo, dtype=np.uint8)
    storage.read_into(file, chunk.byte_offset + lo, memoryview(stored))  # type: ignore[arg-type]
    unpack_checked(stored, file, key, chunk, start, out, verify, segment)


def packed_span(chunk: ChunkMeta, start: int, stop: int, segment: int) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of compressed ``chunk`` as stored: the stored segments that hold its
    raw bytes ``[start, stop)``."""
    assert chunk.compression is not None
    segs = segment_range(start, stop, segment)
    offsets = stored_offsets(chunk.compression)
    return offsets[segs.start], offsets[segs.stop]


def unpack_checked(
    stored: np.ndarray,
    file: str,
    key: str,
    chunk: ChunkMeta,
    start: int,
    out: np.ndarray,
    verify: bool,
    segment: int,
) -> None:
    """Raw bytes ``[start, start + len(out))`` of compressed ``chunk`` into ``out`` from
    ``stored``, its stored segments that hold them (:func:`packed_span`), each checked against
    its checksum (``verify``) before it is decoded."""
    c = chunk.compression
    assert c is not None
    segs = segment_range(start, start + len(out), segment)
    offsets = stored_offsets(c)
    lo = offsets[segs.start]
    if verify:
        for i in segs:
            found = digest(memoryview(stored[offsets[i] - lo : offsets[i + 1] - lo]))  # type: ignore[arg-type]
            if found != chunk.checksums[i]:
                a, b = chunk.byte_offset + offsets[i], chunk.byte_offset + offsets[i + 1]
                raise CheckpointCorruptError(
                    f"checksum mismatch in {file} bytes [{a}, {b}) holding tensor '{key}' "
                    f"(compressed chunk at offsets {list(chunk.offsets)}, segment {i}): "
                    f"expected {chunk.checksums[i]}, found {found}. The file is damaged; load "
                    "an earlier checkpoint or pass verify=False to load it anyway."
                )
    where = f"{file}, tensor '{key}' (chunk at offsets {list(chunk.offsets)})"
    raw = unpack_segments(stored, c, segs.start, chunk.nbytes, segment, where)
    at = start - segs.start * segment
    np.copyto(out, raw[at : at + len(out)])


def check_compress(compress: bool) -> bool:
    """``compress``, once the codec is known to be installed (raises what to install)."""
    if compress:
        check_available()
    return bool(compress)
