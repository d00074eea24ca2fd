"""JSON (de)serialization of the metadata, the per-file indexes and the commit marker.

Never pickle. Any malformed input raises :class:`CheckpointCorruptError`; a newer version
raises :class:`CheckpointVersionError`.
"""

from __future__ import annotations

import binascii
import json
import logging
import math
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointVersionError
from .chunk_map import (
    ChunkMap,
    chunk_map_nbytes,
    chunk_map_rows,
    decode_chunk_map,
    encode_chunk_map,
)
from .dtypes import check_dtype_name, itemsize_of
from .limits import (
    CHUNK_MAP_ROW_INDEX_BYTES,
    MAX_CHUNK_MAP_BYTES,
    MAX_NDIM,
    MAX_TENSOR_BYTES,
    MAX_WORLD_SIZE,
    check_ndim,
)
from .metadata import (
    COMPRESSION_CODEC,
    ENCODING_BITS,
    FORMAT_NAME,
    FORMAT_VERSION,
    PLAIN_FORMAT_VERSION,
    ROWWISE_AFFINE,
    ChunkMeta,
    CommitRecord,
    Compression,
    Encoding,
    EncodingError,
    FileRef,
    Metadata,
    TensorMeta,
    rowwise_stored_width,
)
from .references import FileLocation, FileTable

INDEX_FORMAT = "unickpt-index"
log = logging.getLogger(__name__)
ENCODINGS = (ROWWISE_AFFINE,)
_ERROR = ("max_abs", "rms", "rms_relative")


def encode_metadata(meta: Metadata) -> bytes:
    """The global metadata: tensors (without chunks), files, values."""
    doc = {
        "format": FORMAT_NAME,
        "version": meta.version,
        "world_size": meta.world_size,
        "created_unix_s": meta.created_unix_s,
        "producer": meta.producer,
        "checksum_algorithm": meta.checksum_algorithm,
        "segment_bytes": meta.segment_bytes,
        "files": [asdict(f) for f in meta.file_refs],  # data, nbytes, index, its nbytes, checksum
        "tensors": {k: _encode_tensor(t) for k, t in meta.tensors.items()},
        "objects": meta.objects,
        "per_rank": {k: list(v) for k, v in meta.per_rank.items()},
        "pickled_keys": list(meta.pickled_keys),
        "aliases": dict(meta.aliases),
    }
    if meta.references:
        doc["references"] = list(meta.references)
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    if meta.chunk_map is not None:  # last, as a member of the document
        text = f'{text[:-1]},"chunk_map":{_chunk_map_json(meta.chunk_map)}}}'
    return text.encode("utf-8")


_MAP_TEXT: weakref.WeakKeyDictionary[ChunkMap, str] = weakref.WeakKeyDictionary()


def _chunk_map_json(chunk_map: ChunkMap) -> str:
    """The JSON of a chunk map, kept while the map lives: a save whose plan is cached writes
    the same map every time, and encoding it is most of the metadata's work at scale."""
    text = _MAP_TEXT.get(chunk_map)
    if text is None:
        text = json.dumps(encode_chunk_map(chunk_map), separators=(",", ":"), allow_nan=False)
        _MAP_TEXT[chunk_map] = text
    return text


def decode_metadata(raw: bytes, source: str) -> Metadata:
    """The global metadata; tensors have no chunks until :func:`assemble` adds them."""
    doc = load_json(raw, source)
    check_header(doc, source, FORMAT_NAME)
    try:
        refs = tuple(
            FileRef(
                str(f["data"]),
                int(f["nbytes"]),
                str(f["index"]),
                int(f["index_nbytes"]),
                str(f["index_checksum"]),
            )
            for f in doc["files"]
        )
        tensors = {str(k): _decode_tensor(str(k), v, source) for k, v in doc["tensors"].items()}
        for key, t in tensors.items():
            _check_stored_bytes(key, t, source)
        segment = int(doc["segment_bytes"])
        if segment <= 0 or segment % 16:
            raise ValueError(f"segment_bytes is {segment}, expected a positive multiple of 16")
        world = int(doc["world_size"])
        if not 1 <= world <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size is {world}, expected 1 to {MAX_WORLD_SIZE}")
        return Metadata(
            world_size=world,
            files=tuple(r.data for r in refs),
            tensors=tensors,
            objects=dict(doc["objects"]),
            per_rank={str(k): tuple(v) for k, v in doc["per_rank"].items()},
            segment_bytes=int(doc["segment_bytes"]),
            checksum_algorithm=str(doc["checksum_algorithm"]),
            version=int(doc["version"]),
            created_unix_s=float(doc.get("created_unix_s", 0.0)),
            producer={str(k): str(v) for k, v in doc.get("producer", {}).items()},
            pickled_keys=tuple(str(k) for k in doc.get("pickled_keys", [])),
            file_refs=refs,
            aliases=_aliases(doc.get("aliases", {}), tensors),
            references=tuple(str(s) for s in doc.get("references", [])),
            chunk_map=_chunk_map(doc.get("chunk_map"), refs, tensors, source),
        )
    except (KeyError, TypeError, ValueError, AttributeError, zlib.error, binascii.Error) as e:
        raise CheckpointCorruptError(
            f"{source}: the metadata is not well formed ({type(e).__name__}: {e}); the "
            "checkpoint is damaged. Load an earlier checkpoint."
        ) from e


def _check_stored_bytes(key: str, t: TensorMeta, source: str) -> None:
    """A stored tensor of at most ``MAX_TENSOR_BYTES``; its chunks, each within the bytes of
    its data file (:func:`assemble`), must then tile it before a reader sizes a buffer by it."""
    size = math.prod(t.shape) * itemsize_of(t.dtype)
    if size > MAX_TENSOR_BYTES:
        raise CheckpointCorruptError(
            f"{source}: '{key}' has shape {list(t.shape)} of {t.dtype}, {size} bytes, more than "
            f"the {MAX_TENSOR_BYTES} bytes unickpt stores in one tensor; the metadata is "
            "damaged. Load an earlier checkpoint."
        )


def _chunk_map(
    doc: Any, refs: Sequence[FileRef], tensors: dict[str, TensorMeta], source: str
) -> ChunkMap | None:
    """The metadata's chunk map; None where it has none, or where its files or tensors are not
    those of the metadata (readers then read every index, which says what is damaged).

    Its rows are bounded before anything is inflated: no more than the indexes can list (a
    chunk takes more than ``CHUNK_MAP_ROW_INDEX_BYTES`` of an index), and no more than
    ``MAX_CHUNK_MAP_BYTES`` decoded (a larger map is not used)."""
    if doc is None:
        return None
    files = len(refs)
    index_bytes = sum(max(0, r.index_nbytes) for r in refs)
    rows = chunk_map_rows(doc)
    if rows > index_bytes // CHUNK_MAP_ROW_INDEX_BYTES:
        raise CheckpointCorruptError(
            f"{source}: the chunk map lists {rows} chunks, more than the {files} indexes of "
            f"{index_bytes} bytes can list; the metadata is damaged. Load an earlier checkpoint."
        )
    decoded = chunk_map_nbytes(doc)
    if decoded > MAX_CHUNK_MAP_BYTES:
        log.warning(
            "the chunk map decodes to %d bytes, more than the %d a reader uses; ignored",
            decoded,
            MAX_CHUNK_MAP_BYTES,
        )
        return None
    found = decode_chunk_map(doc)
    fits = (
        found.tensors.keys() == tensors.keys()
        and all(
            (lay := found.layout(k)) is not None and lay.ndim == len(t.shape)
            for k, t in tensors.items()
        )
        and all(
            not len(lay.files) or 0 <= lay.files.min() <= lay.files.max() < files
            for lay in found.layouts
        )
    )
    if not fits:
        log.warning("the chunk map does not describe the metadata's tensors and files; ignored")
        return None
    return found


def _aliases(doc: Any, tensors: dict[str, TensorMeta]) -> dict[str, str]:
    aliases = {str(k): str(v) for k, v in dict(doc).items()}
    for key, target in aliases.items():
        if target not in tensors or key in tensors:
            raise ValueError(f"'{key}' is tied to '{target}', which is not a stored tensor")
    return aliases


def _encode_tensor(t: TensorMeta) -> dict[str, Any]:
    doc: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape), "layout": t.layout}
    if t.encoding is not None:
        doc["encoding"] = encode_encoding(t.encoding)
    return doc


def _decode_tensor(key: str, doc: dict[str, Any], source: str) -> TensorMeta:
    encoding = doc.get("encoding")
    shape = _shape(doc["shape"], f"'{key}'", source)
    t = TensorMeta(
        check_dtype_name(str(doc["dtype"]), key, source),
        shape,
        str(doc["layout"]),
        (),
        None if encoding is None else decode_encoding(encoding, key, source),
    )
    if t.encoding is not None:
        _check_encoded_shape(key, t, t.encoding, source)
    return t


def _shape(doc: Any, what: str, source: str) -> tuple[int, ...]:
    if not isinstance(doc, list):
        raise TypeError(f"the shape of {what} is a {type(doc).__name__}, not a list")
    check_ndim(len(doc), what, source)
    shape = tuple(int(s) for s in doc)
    if any(s < 0 for s in shape):
        raise ValueError(f"the shape of {what} is {list(shape)}")
    return shape


def _check_encoded_shape(key: str, t: TensorMeta, e: Encoding, source: str) -> None:
    """An encoded table's decoded shape is what its stored rows encode: the same rows, and
    stored rows as wide as the columns at ``bits`` need (its value bytes then stay within a
    small multiple of its stored bytes, which the data files hold)."""
    sound = (
        e.bits in ENCODING_BITS
        and len(e.shape) == 2
        and len(t.shape) == 2
        and t.dtype == "uint8"
        and t.shape == (e.shape[0], rowwise_stored_width(e.shape[1], e.bits))
    )
    if not sound:
        raise CheckpointCorruptError(
            f"{source}: '{key}' is stored as {t.dtype} {list(t.shape)} with encoding {e.name} "
            f"of {e.bits} bits of {list(e.shape)}; {e.bits}-bit rows of {list(e.shape)} are "
            "stored as uint8 rows of a scale, a minimum and the codes. The metadata is "
            "damaged. Load an earlier checkpoint."
        )


def encode_encoding(e: Encoding) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": e.name,
        "bits": e.bits,
        "dtype": e.dtype,
        "shape": list(e.shape),
        "scale_dtype": e.scale_dtype,
    }
    if e.error is not None:
        doc["error"] = asdict(e.error)
    return doc


def decode_encoding(doc: dict[str, Any], key: str = "?", source: str = "metadata") -> Encoding:
    if doc["name"] not in ENCODINGS:
        raise ValueError(
            f"encoding {doc['name']!r} is not one this unickpt knows ({', '.join(ENCODINGS)})"
        )
    error = doc.get("error")
    return Encoding(
        name=str(doc["name"]),
        bits=int(doc["bits"]),
        dtype=check_dtype_name(str(doc["dtype"]), key, source),
        shape=_shape(doc["shape"], f"the encoding of '{key}'", source),
        scale_dtype=check_dtype_name(str(doc.get("scale_dtype", "float32")), key, source),
        error=None if error is None else EncodingError(**{k: float(error[k]) for k in _ERROR}),
    )


def encode_index(
    data_file: str,
    entries: Sequence[tuple[str, ChunkMeta]],
    refs: Sequence[FileLocation] = (),
    runs: Sequence[tuple[str, Sequence[ChunkMeta]]] = (),
) -> bytes:
    """One data file's chunks: ``[key, offsets, lengths, byte_offset, nbytes, checksums]``.

    A chunk whose ``file`` is ``r + 1`` lies in the earlier checkpoint's file ``refs[r]``
    (format version 2): its entry gets a seventh element ``r`` and the index lists ``refs``.
    A compressed chunk (format version 3) gets a seventh element ``r`` or null and an eighth,
    ``{"codec", "width", "stored"}`` (:func:`encode_compression`).
    Each of ``runs`` is the consecutive row pieces of one box (a table saved with row deltas),
    written as one entry of ``runs`` (see docs/format.md) when they allow it.
    """
    chunks, compact = [], []
    for k, c in entries:
        chunks.append(_chunk_row(k, c))
    for k, pieces in runs:
        run = None if any(c.compression for c in pieces) else _row_runs(k, pieces)
        if run is None:
            chunks.extend(_chunk_row(k, c) for c in pieces)
        else:
            compact.append(run)
    compressed = any(len(row) > 7 for row in chunks)
    doc: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "version": FORMAT_VERSION if compressed else PLAIN_FORMAT_VERSION,
        "data": data_file,
        "chunks": chunks,
    }
    if compact:
        doc["runs"] = compact
    if refs:
        doc["refs"] = [[r.step, r.data] for r in refs]
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def _chunk_row(k: str, c: ChunkMeta) -> list[Any]:
    row = [k, list(c.offsets), list(c.lengths), c.byte_offset, c.nbytes, list(c.checksums)]
    if c.file or c.compression is not None:
        row.append(c.file - 1 if c.file else None)
    if c.compression is not None:
        row.append(encode_compression(c.compression))
    return row


def encode_compression(c: Compression) -> dict[str, Any]:
    return {"codec": c.codec, "width": c.width, "stored": list(c.stored)}


def decode_compression(doc: Any, key: str, nbytes: int, segment_count: int) -> Compression:
    """A chunk's compression, checked: a codec this unickpt reads, one stored size per
    checksum segment, none larger than a segment's raw bytes (so a forged size cannot make a
    reader allocate or read more than the raw chunk)."""
    if not isinstance(doc, dict):
        raise TypeError(f"the compression of a chunk of '{key}' is a {type(doc).__name__}")
    codec, width = str(doc["codec"]), int(doc["width"])
    stored = tuple(int(n) for n in doc["stored"])
    if codec != COMPRESSION_CODEC:
        raise ValueError(
            f"a chunk of '{key}' is compressed with {codec!r}, which this unickpt does not "
            f"read (it reads {COMPRESSION_CODEC!r})"
        )
    if not 1 <= width <= 16 or len(stored) != segment_count:
        raise ValueError(
            f"a chunk of '{key}' has compression width {width} and {len(stored)} stored "
            f"sizes for {segment_count} checksums"
        )
    if any(n < 0 for n in stored) or sum(stored) > nbytes:
        raise ValueError(f"a chunk of '{key}' stores {sum(stored)} bytes for {nbytes} raw bytes")
    return Compression(codec, width, stored)


_DIGEST_CHARS = 16


def _row_runs(key: str, pieces: Sequence[ChunkMeta]) -> list[Any] | None:
    """``[key, offsets, lengths, row_bytes, rows, files, byte_offsets, checksums]`` of
    consecutive row pieces of one box, or None when they are not such pieces."""
    if not pieces or any(len(c.lengths) < 1 or c.lengths[0] < 1 for c in pieces):
        return None
    first = pieces[0]
    row_bytes, rest = divmod(first.nbytes, first.lengths[0])
    start = first.offsets[0]
    for c in pieces:
        sound = (
            c.offsets[0] == start
            and c.offsets[1:] == first.offsets[1:]
            and c.lengths[1:] == first.lengths[1:]
            and c.nbytes == c.lengths[0] * row_bytes
            and all(len(d) == _DIGEST_CHARS for d in c.checksums)
        )
        if rest or not sound:
            return None
        start += c.lengths[0]
    lengths = [start - first.offsets[0], *first.lengths[1:]]
    return [
        key,
        list(first.offsets),
        lengths,
        row_bytes,
        [c.lengths[0] for c in pieces],
        [c.file for c in pieces],
        [c.byte_offset for c in pieces],
        ["".join(c.checksums) for c in pieces],
    ]


def decode_runs(
    row: list[Any], file: int, refs: list[FileLocation], files: FileTable | None
) -> list[tuple[str, ChunkMeta]]:
    key, offsets, lengths, row_bytes, rows, numbers, byte_offsets, checksums = row
    if len(offsets) != len(lengths) or not 1 <= len(offsets) <= MAX_NDIM:
        raise ValueError(f"the row runs of '{key}' have {len(offsets)} offsets and lengths")
    if not len(rows) == len(numbers) == len(byte_offsets) == len(checksums):
        raise ValueError(f"the row runs of '{key}' have lists of different lengths")
    if sum(int(n) for n in rows) != int(lengths[0]) or int(row_bytes) < 0:
        raise ValueError(f"the row runs of '{key}' do not add up to its {lengths[0]} rows")
    out = []
    start = int(offsets[0])
    for n, number, at, sums in zip(rows, numbers, byte_offsets, checksums):
        text = str(sums)
        if len(text) % _DIGEST_CHARS or not text:
            raise ValueError(
                f"the checksums of a row run of '{key}' are {len(text)} characters, expected "
                f"{_DIGEST_CHARS} per segment"
            )
        ref = [] if int(number) == 0 else [int(number) - 1]
        chunk = ChunkMeta(
            offsets=(start, *(int(o) for o in offsets[1:])),
            lengths=(int(n), *(int(x) for x in lengths[1:])),
            file=_file_number(file, ref, refs, files),
            byte_offset=int(at),
            nbytes=int(n) * int(row_bytes),
            checksums=tuple(
                text[i : i + _DIGEST_CHARS] for i in range(0, len(text), _DIGEST_CHARS)
            ),
        )
        if chunk.byte_offset < 0 or chunk.lengths[0] < 1:
            raise ValueError(f"row run of '{key}' at offset {chunk.byte_offset}")
        out.append((str(key), chunk))
        start += int(n)
    return out


def decode_index(
    raw: bytes, source: str, file: int, files: FileTable | None = None
) -> list[tuple[str, ChunkMeta]]:
    """The chunks of an index; chunks in this index's data file get number ``file``, chunks
    that refer to an earlier checkpoint's file get the number ``files`` gives it."""
    doc = load_json(raw, source)
    check_header(doc, source, INDEX_FORMAT)
    try:
        refs = [FileLocation(str(step), str(data)) for step, data in doc.get("refs", [])]
        out = []
        for row in doc["chunks"]:
            key, offsets, lengths, byte_offset, nbytes, checksums, *rest = row
            ref = [r for r in rest[:1] if r is not None]
            packed = rest[1] if len(rest) > 1 else None
            chunk = ChunkMeta(
                offsets=tuple(int(o) for o in offsets),
                lengths=tuple(int(n) for n in lengths),
                file=_file_number(file, ref, refs, files),
                byte_offset=int(byte_offset),
                nbytes=int(nbytes),
                checksums=tuple(str(c) for c in checksums),
                compression=None
                if packed is None
                else decode_compression(packed, str(key), int(nbytes), len(checksums)),
            )
            if chunk.byte_offset < 0 or chunk.nbytes < 0:
                raise ValueError(f"chunk of '{key}' at offset {chunk.byte_offset}")
            if len(chunk.offsets) != len(chunk.lengths) or len(chunk.offsets) > MAX_NDIM:
                raise ValueError(f"chunk of '{key}' has {len(chunk.offsets)} offsets")
            if not chunk.checksums:
                raise no_checksums(str(key), source)
            out.append((str(key), chunk))
        for row in doc.get("runs", []):
            out.extend(decode_runs(row, file, refs, files))
        return out
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise CheckpointCorruptError(
            f"{source}: the index is not well formed ({type(e).__name__}: {e}); the "
            "checkpoint is damaged. Load an earlier checkpoint."
        ) from e


def no_checksums(key: str, source: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{source}: the chunk of '{key}' has no checksums; expected one per segment. The index "
        "is damaged (a chunk without checksums would load unverified). Load an earlier "
        "checkpoint."
    )


def _file_number(
    own: int, ref: list[Any], refs: list[FileLocation], files: FileTable | None
) -> int:
    if not ref:
        return own
    if len(ref) != 1 or not isinstance(ref[0], int) or not 0 <= ref[0] < len(refs):
        raise ValueError(f"reference {ref} is not one of the index's {len(refs)} refs")
    if files is None:
        raise ValueError("a chunk refers to another checkpoint's file; read it with its refs")
    return files.number(refs[ref[0]])


def assemble(meta: Metadata, indexes: Sequence[list[tuple[str, ChunkMeta]]]) -> Metadata:
    """The metadata with every tensor's chunks, from the global file and the file indexes."""
    chunks: dict[str, list[ChunkMeta]] = {k: [] for k in meta.tensors}
    sizes = {k: itemsize_of(t.dtype) for k, t in meta.tensors.items()}
    for entries in indexes:
        for key, chunk in entries:
            target = chunks.get(key)
            shape = meta.tensors[key].shape if target is not None else None
            if target is None or shape is None or not chunk.box.within(shape):
                raise CheckpointCorruptError(
                    f"an index lists a chunk of '{key}' at {list(chunk.offsets)} that the "
                    "metadata does not describe; the checkpoint is damaged."
                )
            expected = chunk.box.numel * sizes[key]
            segments = max(1, -(-expected // meta.segment_bytes))
            _check_in_file(meta, key, chunk)
            if chunk.nbytes != expected or len(chunk.checksums) != segments:
                raise CheckpointCorruptError(
                    f"an index gives the chunk of '{key}' at {list(chunk.offsets)} {chunk.nbytes} "
                    f"bytes and {len(chunk.checksums)} checksums; its box and dtype need "
                    f"{expected} bytes and {segments} checksums. The checkpoint is damaged."
                )
            target.append(chunk)
    tensors = {
        k: replace(t, chunks=tuple(sorted(chunks[k], key=lambda c: c.offsets)))
        for k, t in meta.tensors.items()
    }
    return replace(meta, tensors=tensors)


def _check_in_file(meta: Metadata, key: str, chunk: ChunkMeta) -> None:
    """A chunk within the bytes the metadata gives its data file."""
    if not meta.file_refs or not 0 <= chunk.file < len(meta.file_refs):
        return  # a chunk of no listed file: the read reports it
    size = meta.file_refs[chunk.file].nbytes
    if chunk.byte_offset + chunk.stored_nbytes > size:
        raise CheckpointCorruptError(
            f"an index places the chunk of '{key}' at {list(chunk.offsets)} at bytes "
            f"{chunk.byte_offset} to {chunk.byte_offset + chunk.stored_nbytes} of "
            f"{meta.file_refs[chunk.file].data}, which the metadata gives {size} bytes; the "
            "checkpoint is damaged (truncated). Load an earlier checkpoint."
        )


def encode_commit(record: CommitRecord) -> bytes:
    # The version second, as before the record's fields (which hold it too).
    doc = {"format": FORMAT_NAME, "version": record.version, **asdict(record)}
    return json.dumps(doc, indent=1).encode("utf-8")


def decode_commit(raw: bytes, source: str) -> CommitRecord:
    doc = load_json(raw, source)
    check_header(doc, source, FORMAT_NAME)
    try:
        return CommitRecord(
            metadata_file=str(doc["metadata_file"]),
            metadata_nbytes=int(doc["metadata_nbytes"]),
            metadata_checksum=str(doc["metadata_checksum"]),
            save_id=str(doc["save_id"]),
            version=int(doc["version"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorruptError(
            f"{source}: the commit marker is not well formed ({e}); the checkpoint is damaged."
        ) from e


def load_json(raw: bytes, source: str) -> dict[str, Any]:
    """The JSON object of a metadata, index or commit file; any bytes that are not one (not
    UTF-8, not JSON, nested deeper than the parser goes) are damage named by ``source``."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError: ValueError
        raise CheckpointCorruptError(
            f"{source}: expected JSON written by unickpt, found {len(raw)} bytes that do not "
            f"parse ({type(e).__name__}: {e}); the file is damaged. Load an earlier checkpoint."
        ) from e
    if not isinstance(doc, dict):
        raise CheckpointCorruptError(f"{source}: expected a JSON object, found {type(doc)}.")
    return doc


def check_header(doc: dict[str, Any], source: str, name: str) -> None:
    if doc.get("format") != name:
        raise CheckpointCorruptError(
            f"{source}: format is {doc.get('format')!r}, expected {name!r}; this is not "
            "a unickpt file or it is damaged."
        )
    version = doc.get("version")
    if not isinstance(version, int) or version < 1:
        raise CheckpointCorruptError(
            f"{source}: the format version {version!r} is not one unickpt writes (1 to "
            f"{FORMAT_VERSION}); the file is damaged."
        )
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{source}: written in format version {version}, this unickpt reads versions up to "
            f"{FORMAT_VERSION}. Upgrade unickpt (pip install -U unickpt) to load it."
        )
