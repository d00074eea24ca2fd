"""JSON (de)serialization of the metadata and the commit marker. Never pickle.

Any malformed input raises :class:`CheckpointCorruptError`; a newer version raises
:class:`CheckpointVersionError`.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointVersionError
from .metadata import FORMAT_NAME, FORMAT_VERSION, ChunkMeta, CommitRecord, Metadata, TensorMeta


def encode_metadata(meta: Metadata) -> bytes:
    doc = {
        "format": FORMAT_NAME,
        "version": meta.version,
        "world_size": meta.world_size,
        "created_unix_s": meta.created_unix_s,
        "producer": meta.producer,
        "checksum_algorithm": meta.checksum_algorithm,
        "segment_bytes": meta.segment_bytes,
        "files": list(meta.files),
        "tensors": {k: _encode_tensor(t) for k, t in meta.tensors.items()},
        "objects": meta.objects,
        "per_rank": {k: list(v) for k, v in meta.per_rank.items()},
        "pickled_keys": list(meta.pickled_keys),
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _encode_tensor(t: TensorMeta) -> dict[str, Any]:
    return {
        "dtype": t.dtype,
        "shape": list(t.shape),
        "layout": t.layout,
        "chunks": [
            [list(c.offsets), list(c.lengths), c.file, c.byte_offset, c.nbytes, list(c.checksums)]
            for c in t.chunks
        ],
    }


def decode_metadata(raw: bytes, source: str) -> Metadata:
    doc = _load_json(raw, source)
    _check_header(doc, source)
    try:
        files = tuple(str(f) for f in doc["files"])
        tensors = {str(k): _decode_tensor(v, len(files)) for k, v in doc["tensors"].items()}
        return Metadata(
            world_size=int(doc["world_size"]),
            files=files,
            tensors=tensors,
            objects=dict(doc["objects"]),
            per_rank={str(k): tuple(v) for k, v in doc["per_rank"].items()},
            segment_bytes=int(doc["segment_bytes"]),
            checksum_algorithm=str(doc["checksum_algorithm"]),
            version=int(doc["version"]),
            created_unix_s=float(doc.get("created_unix_s", 0.0)),
            producer={str(k): str(v) for k, v in doc.get("producer", {}).items()},
            pickled_keys=tuple(str(k) for k in doc.get("pickled_keys", [])),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointCorruptError(
            f"{source}: the metadata is not well formed ({type(e).__name__}: {e}); the "
            "checkpoint is damaged. Load an earlier checkpoint."
        ) from e


def _decode_tensor(doc: dict[str, Any], nfiles: int) -> TensorMeta:
    shape = tuple(int(s) for s in doc["shape"])
    chunks = []
    for offsets, lengths, file, byte_offset, nbytes, checksums in doc["chunks"]:
        chunk = ChunkMeta(
            offsets=tuple(int(o) for o in offsets),
            lengths=tuple(int(n) for n in lengths),
            file=int(file),
            byte_offset=int(byte_offset),
            nbytes=int(nbytes),
            checksums=tuple(str(c) for c in checksums),
        )
        if not (0 <= chunk.file < nfiles) or chunk.byte_offset < 0 or chunk.nbytes < 0:
            raise ValueError(f"chunk points at file {chunk.file}, offset {chunk.byte_offset}")
        if not chunk.box.within(shape):
            raise ValueError(f"chunk {chunk.box} lies outside shape {shape}")
        chunks.append(chunk)
    return TensorMeta(str(doc["dtype"]), shape, str(doc["layout"]), tuple(chunks))


def encode_commit(record: CommitRecord) -> bytes:
    doc = {
        "format": FORMAT_NAME,
        "version": record.version,
        "metadata_file": record.metadata_file,
        "metadata_nbytes": record.metadata_nbytes,
        "metadata_checksum": record.metadata_checksum,
        "save_id": record.save_id,
    }
    return json.dumps(doc, indent=1).encode("utf-8")


def decode_commit(raw: bytes, source: str) -> CommitRecord:
    doc = _load_json(raw, source)
    _check_header(doc, source)
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


def _load_json(raw: bytes, source: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointCorruptError(
            f"{source}: expected JSON written by unickpt, found {len(raw)} bytes that do not "
            f"parse ({e}); the file is damaged. Load an earlier checkpoint."
        ) from e
    if not isinstance(doc, dict):
        raise CheckpointCorruptError(f"{source}: expected a JSON object, found {type(doc)}.")
    return doc


def _check_header(doc: dict[str, Any], source: str) -> None:
    if doc.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(
            f"{source}: format is {doc.get('format')!r}, expected {FORMAT_NAME!r}; this is not "
            "a unickpt file or it is damaged."
        )
    version = doc.get("version")
    if not isinstance(version, int):
        raise CheckpointCorruptError(f"{source}: the format version {version!r} is not a number.")
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{source}: written in format version {version}, this unickpt reads versions up to "
            f"{FORMAT_VERSION}. Upgrade unickpt (pip install -U unickpt) to load it."
        )
