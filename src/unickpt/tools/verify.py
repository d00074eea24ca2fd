"""Check every byte of a checkpoint against its checksums, without loading it.

In order: the commit marker, the metadata (size and checksum pinned by the marker), the
metadata's consistency (chunk sizes, checksum counts, coverage), every data file's presence and
size, then every checksum segment of every chunk, read in parallel pieces of bounded size. An
incremental checkpoint's references are followed: the bytes it refers to in earlier step
folders are verified against the checksums it records.
"""

from __future__ import annotations

import functools
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..config import get_config
from ..engine.checksum import ALGORITHM, digest
from ..engine.commit import read_checkpoint, read_commit
from ..engine.references import resolving
from ..errors import CheckpointError, CheckpointNotFoundError, CheckpointVersionError
from ..format.codec import decode_metadata
from ..format.dtypes import itemsize_of
from ..format.metadata import COMMIT_FILE, ChunkMeta, Metadata
from ..format.references import parse_reference
from ..storage.base import Storage
from ..storage.registry import open_storage
from .datafiles import expected_file_sizes
from .progress import ProgressFn

MiB = 1 << 20
DEFAULT_PIECE_BYTES = 16 * MiB


@dataclass(frozen=True)
class Damage:
    """One problem found: where (file, tensor, byte range of the file) and what."""

    file: str
    key: str | None
    start: int | None
    stop: int | None
    message: str


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of :func:`verify_checkpoint`; ``ok`` when nothing is damaged."""

    path: str
    files: int
    chunks: int
    segments: int
    bytes_verified: int
    elapsed_s: float
    damage: tuple[Damage, ...]

    @property
    def ok(self) -> bool:
        return not self.damage

    @property
    def mb_per_s(self) -> float:
        return self.bytes_verified / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(frozen=True)
class _Piece:
    """Segments ``[first, first + count)`` of one chunk, read and hashed in one go."""

    file: str
    key: str
    chunk: ChunkMeta
    first: int
    count: int


def verify_checkpoint(
    path: str | os.PathLike[str] | Storage,
    *,
    io_threads: int | None = None,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    progress: ProgressFn | None = None,
) -> VerifyReport:
    """Verify the checkpoint at ``path``; damage is reported, not raised.

    Raises :class:`CheckpointNotFoundError` when ``path`` holds no committed checkpoint.

    >>> report = verify_checkpoint("ckpt/step-100")  # doctest: +SKIP
    >>> report.ok, report.bytes_verified  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    storage = resolving(open_storage(path))
    try:
        meta, meta_file, damage = _read_metadata(storage)
        if meta is None:
            return VerifyReport(storage.location, 0, 0, 0, 0, time.perf_counter() - t0, damage)
        damage += _check_layout(meta, meta_file)
        sizes, file_damage = _check_files(storage, meta)
        pieces, beyond = _plan_pieces(meta, sizes, piece_bytes)
        threads = io_threads or get_config().io_threads
        checked, bad = _hash_pieces(storage, pieces, meta.segment_bytes, threads, progress)
    finally:
        storage.close()
    chunks = sum(len(t.chunks) for t in meta.tensors.values())
    segments = sum(p.count for p in pieces)
    found = (*damage, *file_damage, *beyond, *_merge(bad, meta.segment_bytes))
    return VerifyReport(
        storage.location,
        len(meta.files),
        chunks,
        segments,
        checked,
        time.perf_counter() - t0,
        found,
    )


def _read_metadata(storage: Storage) -> tuple[Metadata | None, str, tuple[Damage, ...]]:
    """The metadata (None when damaged), the metadata file's name, and the damage found."""
    try:
        record, meta = read_checkpoint(storage)
    except (CheckpointNotFoundError, CheckpointVersionError):
        raise
    except CheckpointError as e:
        return None, COMMIT_FILE, (Damage(_damaged_file(storage), None, None, None, str(e)),)
    if meta.checksum_algorithm != ALGORITHM:
        message = (
            f"the metadata names checksum algorithm {meta.checksum_algorithm!r}; this unickpt "
            f"verifies {ALGORITHM!r}. Upgrade unickpt to verify this checkpoint."
        )
        return (
            None,
            record.metadata_file,
            (Damage(record.metadata_file, None, None, None, message),),
        )
    return meta, record.metadata_file, ()


def _damaged_file(storage: Storage) -> str:
    """Which of the commit marker, the metadata and the index files fails its check."""
    try:
        record = read_commit(storage)
    except CheckpointError:
        return COMMIT_FILE
    if record is None:
        return COMMIT_FILE
    raw = storage.read_bytes(record.metadata_file)
    if not _matches(raw, record.metadata_nbytes, record.metadata_checksum):
        return record.metadata_file
    assert raw is not None
    try:
        refs = decode_metadata(raw, record.metadata_file).file_refs
    except CheckpointError:
        return record.metadata_file
    for ref in refs:
        if not _matches(storage.read_bytes(ref.index), ref.index_nbytes, ref.index_checksum):
            return ref.index
    return record.metadata_file


def _matches(raw: bytes | None, nbytes: int, checksum: str) -> bool:
    return raw is not None and len(raw) == nbytes and digest(memoryview(raw)) == checksum


def _at_chunk(meta: Metadata, key: str, c: ChunkMeta, message: str) -> Damage:
    return Damage(meta.files[c.file], key, c.byte_offset, c.byte_offset + c.stored_nbytes, message)


def _check_layout(meta: Metadata, meta_file: str) -> tuple[Damage, ...]:
    """Chunk sizes, checksum counts and coverage as the metadata states them."""
    found = []
    for key, t in sorted(meta.tensors.items()):
        try:
            size = itemsize_of(t.dtype)
        except CheckpointError as e:
            found.append(Damage(meta_file, key, None, None, str(e)))
            continue
        for c in t.chunks:
            where = f"the chunk of '{key}' at offsets {list(c.offsets)}"
            if c.nbytes != c.box.numel * size:
                expected = f"{c.box.numel * size} ({c.box.numel} x {t.dtype})"
                message = f"{where} has {c.nbytes} bytes, expected {expected}; {_DAMAGED_META}"
                found.append(_at_chunk(meta, key, c, message))
            segments = max(1, math.ceil(c.nbytes / meta.segment_bytes))
            if len(c.checksums) != segments:
                message = (
                    f"{where} has {len(c.checksums)} checksums, expected {segments} (one per "
                    f"{meta.segment_bytes} bytes); {_DAMAGED_META}"
                )
                found.append(_at_chunk(meta, key, c, message))
        covered, expected_numel = sum(c.box.numel for c in t.chunks), math.prod(t.shape)
        if covered != expected_numel:
            message = (
                f"the chunks of '{key}' hold {covered} elements, but its shape {list(t.shape)} "
                f"has {expected_numel}; {_DAMAGED_META}"
            )
            found.append(Damage(meta_file, key, None, None, message))
    return tuple(found)


_DAMAGED_META = "the metadata is damaged. Load an earlier checkpoint."


def _check_files(storage: Storage, meta: Metadata) -> tuple[dict[str, int], tuple[Damage, ...]]:
    """The size of each data file that exists; damage for missing or wrongly sized ones."""
    ends = expected_file_sizes(meta)
    sizes: dict[str, int] = {}
    found = []
    for name, end in zip(meta.files, ends):
        where = f"{storage.location}/{name}"
        try:
            size = storage.size(name)
        except CheckpointError as e:  # a referenced step that is gone
            found.append(Damage(name, None, None, None, str(e)))
            continue
        if size is None:
            message = (
                f"{where} is missing, but the metadata places {end} bytes of data in it; the "
                "checkpoint is incomplete. Load an earlier checkpoint."
            )
            found.append(Damage(name, None, None, None, message))
            continue
        sizes[name] = size
        if size != end and (size < end or parse_reference(name) is None):
            state = "truncated" if size < end else "longer than written"
            message = (
                f"{where} has {size} bytes, expected {end}: the file is {state}. Load an "
                "earlier checkpoint."
            )
            found.append(Damage(name, None, min(size, end), max(size, end), message))
    return sizes, tuple(found)


def _plan_pieces(
    meta: Metadata, sizes: dict[str, int], piece_bytes: int
) -> tuple[list[_Piece], tuple[Damage, ...]]:
    """Pieces to hash for every chunk inside its file; damage for chunks past a file's end."""
    per_piece = max(1, piece_bytes // meta.segment_bytes)
    pieces: list[_Piece] = []
    beyond = []
    for key, t in sorted(meta.tensors.items()):
        for c in t.chunks:
            name = meta.files[c.file]
            end = c.byte_offset + c.stored_nbytes
            if name not in sizes:
                continue
            if end > sizes[name]:
                message = (
                    f"tensor '{key}' (chunk at offsets {list(c.offsets)}) lies at bytes "
                    f"[{c.byte_offset}, {end}) of {name}, which ends at byte {sizes[name]}; the "
                    "file is truncated. Load an earlier checkpoint."
                )
                beyond.append(_at_chunk(meta, key, c, message))
                continue
            n = len(c.checksums)
            starts = range(0, n, per_piece)
            pieces += [_Piece(name, key, c, i, min(per_piece, n - i)) for i in starts]
    return pieces, tuple(beyond)


_Bad = tuple[_Piece, int, str, str]


def _hash_pieces(
    storage: Storage,
    pieces: list[_Piece],
    segment: int,
    threads: int,
    progress: ProgressFn | None,
) -> tuple[int, list[_Bad]]:
    total = sum(_piece_bytes(p, segment) for p in pieces)
    done = 0
    bad: list[_Bad] = []
    run = functools.partial(_hash_piece, storage, segment=segment)
    with ThreadPoolExecutor(threads, thread_name_prefix="unickpt-verify") as pool:
        for nbytes, found in pool.map(run, pieces):
            done += nbytes
            bad += found
            if progress is not None:
                progress(done, total)
    return done, bad


def _stored_span(c: ChunkMeta, first: int, stop: int, segment: int) -> tuple[int, int]:
    """Where the stored bytes of segments ``[first, stop)`` of chunk ``c`` lie in it (a
    compressed chunk's segments take the stored sizes its index gives)."""
    if c.compression is not None:
        return sum(c.compression.stored[:first]), sum(c.compression.stored[:stop])
    return first * segment, max(first * segment, min(c.nbytes, stop * segment))


def _piece_bytes(p: _Piece, segment: int) -> int:
    lo, hi = _stored_span(p.chunk, p.first, p.first + p.count, segment)
    return hi - lo


def _hash_piece(storage: Storage, p: _Piece, segment: int) -> tuple[int, list[_Bad]]:
    start = _stored_span(p.chunk, p.first, p.first, segment)[0]
    n = _piece_bytes(p, segment)
    buf = bytearray(n)
    view = memoryview(buf)
    if n:
        storage.read_into(p.file, p.chunk.byte_offset + start, view)
    bad = []
    for i in range(p.count):
        index = p.first + i
        lo, hi = _stored_span(p.chunk, index, index + 1, segment)
        found = digest(view[lo - start : hi - start])
        if found != p.chunk.checksums[index]:
            bad.append((p, index, p.chunk.checksums[index], found))
    return n, bad


def _merge(bad: list[_Bad], segment: int) -> tuple[Damage, ...]:
    """One damage per run of consecutive bad segments of a chunk."""
    runs: list[list[_Bad]] = []
    for item in sorted(bad, key=lambda b: (b[0].file, b[0].chunk.byte_offset, b[1])):
        last = runs[-1][-1] if runs else None
        if last is not None and last[0].chunk == item[0].chunk and last[1] + 1 == item[1]:
            runs[-1].append(item)
        else:
            runs.append([item])
    return tuple(_damage(run, segment) for run in runs)


def _damage(run: list[_Bad], segment: int) -> Damage:
    p, first, expected, found = run[0]
    c = p.chunk
    lo, hi = _stored_span(c, first, run[-1][1] + 1, segment)
    lo, hi = c.byte_offset + lo, c.byte_offset + hi
    if len(run) == 1:
        what = f"expected {expected}, found {found}"
    else:
        what = f"{len(run)} segments of {segment} bytes fail their checksums"
    message = (
        f"checksum mismatch in {p.file} bytes [{lo}, {hi}) holding tensor '{p.key}' (chunk at "
        f"offsets {list(c.offsets)}): {what}. The file is damaged; load an earlier checkpoint."
    )
    return Damage(p.file, p.key, lo, hi, message)
