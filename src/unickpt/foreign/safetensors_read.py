"""A Hugging Face safetensors checkpoint as unickpt metadata, so a load reads it online.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's
dtype, shape and ``data_offsets`` (relative to the end of the header), then the raw bytes. A
sharded model adds ``model.safetensors.index.json`` whose ``weight_map`` names each tensor's
file. Each tensor becomes one chunk (its whole box) at its byte range; the planner and reader of
a unickpt load then read, on each rank, only the bytes of the rows and boxes it holds. The files
carry no checksums: their chunks are read unverified (the load report names the files).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from ..format.dtypes import dtype_name, itemsize
from ..format.metadata import ChunkMeta, Metadata, TensorMeta
from ..storage.base import Storage
from .common import DTYPE_NAMES, FORMAT_KEY, INDEX_FILE, SEGMENT_BYTES, SINGLE_FILE

SAFETENSORS = "safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The largest JSON header read (the safetensors library refuses larger ones too)."""
_TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def is_safetensors(storage: Storage, name: str | None) -> bool:
    """Whether ``name`` (or the folder, without one) is a safetensors checkpoint."""
    if name is not None:
        return name.endswith((".safetensors", ".json"))
    return storage.size(INDEX_FILE) is not None or storage.size(SINGLE_FILE) is not None


def read_safetensors(storage: Storage, name: str | None = None) -> Metadata:
    """The metadata of the safetensors checkpoint in ``storage``: ``name`` (a ``.safetensors``
    file or an index ``.json``), else the folder's ``model.safetensors``, else its index (the
    order of ``from_pretrained``, which an overwrite relies on: see
    :mod:`.safetensors_write`)."""
    files = _data_files(storage, name)
    tensors: dict[str, TensorMeta] = {}
    for number, file in enumerate(files):
        for key, tensor in _read_file(storage, file, number).items():
            if key in tensors:
                raise CheckpointCorruptError(
                    f"'{key}' is stored in two files of {storage.location} ({file} and an "
                    "earlier one); a safetensors model stores each tensor once. Remove the "
                    "stale shard."
                )
            tensors[key] = tensor
    return Metadata(
        world_size=1,
        files=tuple(files),
        tensors=tensors,
        objects={},
        per_rank={},
        segment_bytes=SEGMENT_BYTES,
        producer={FORMAT_KEY: SAFETENSORS},
    )


def _data_files(storage: Storage, name: str | None) -> list[str]:
    if name is not None and name.endswith(".safetensors"):
        return [name]
    if name is None and storage.size(SINGLE_FILE) is not None:
        return [SINGLE_FILE]
    index = name or INDEX_FILE
    raw = storage.read_bytes(index)
    if raw is None:
        raise CheckpointNotFoundError(
            f"{storage.location}/{index} does not exist; expected a safetensors index or "
            f"{SINGLE_FILE}. Check the path."
        )
    try:
        weight_map = json.loads(raw)["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointCorruptError(
            f"{storage.location}/{index} is not a safetensors index (a JSON object with a "
            f"'weight_map' of tensor names to files): {e}. Check the file."
        ) from e
    for file in files:
        if not isinstance(file, str) or "/" in file or file.startswith("."):
            raise CheckpointCorruptError(
                f"{storage.location}/{index} names file {file!r}; expected a file name in the "
                "same folder. Check the index."
            )
    return files


def _read_file(storage: Storage, file: str, number: int) -> dict[str, TensorMeta]:
    where = f"{storage.location}/{file}"
    size = storage.size(file)
    if size is None:
        raise CheckpointNotFoundError(
            f"{where} does not exist but the safetensors index names it; the model is "
            "incomplete. Download the missing shard."
        )
    header = _read_header(storage, file, size)
    start = 8 + len(header)
    try:
        doc = json.loads(header)
    except ValueError as e:
        raise CheckpointCorruptError(f"{where} has a header that is not JSON ({e}).") from e
    if not isinstance(doc, dict):
        raise CheckpointCorruptError(f"{where} has a header that is not a JSON object.")
    return {
        key: _tensor(where, key, entry, number, start, size)
        for key, entry in doc.items()
        if key != "__metadata__"
    }


def _read_header(storage: Storage, file: str, size: int) -> bytes:
    where = f"{storage.location}/{file}"
    if size < 8:
        raise CheckpointCorruptError(
            f"{where} has {size} bytes; a safetensors file starts with an 8-byte header length."
        )
    prefix = bytearray(8)
    storage.read_into(file, 0, memoryview(prefix))
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise CheckpointCorruptError(
            f"{where} gives a header of {length} bytes but the file has {size} bytes (the "
            f"header is at most {MAX_HEADER_BYTES}); the file is truncated or not safetensors."
        )
    header = bytearray(length)
    storage.read_into(file, 8, memoryview(header))
    return bytes(header)


def _tensor(where: str, key: str, entry: Any, number: int, start: int, size: int) -> TensorMeta:
    try:
        dtype = _TORCH_DTYPES[entry["dtype"]]
        shape = tuple(int(n) for n in entry["shape"])
        begin, end = (int(n) for n in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorruptError(
            f"{where}: the header entry of '{key}' ({str(entry)[:120]}) is not a safetensors "
            f"tensor entry with a known dtype ({', '.join(sorted(_TORCH_DTYPES))}), shape and "
            "data_offsets."
        ) from e
    nbytes = math.prod(shape) * itemsize(dtype)
    if begin < 0 or end - begin != nbytes or any(n < 0 for n in shape):
        raise CheckpointCorruptError(
            f"{where}: '{key}' ({entry['dtype']} {list(shape)}, {nbytes} bytes) has data_offsets "
            f"[{begin}, {end}]; the header is damaged."
        )
    if start + end > size:
        raise CheckpointCorruptError(
            f"{where}: the header places '{key}' at bytes [{start + begin}, {start + end}) but "
            f"the file has {size} bytes; the file is truncated or its header is damaged. "
            "Download the model again."
        )
    chunk = ChunkMeta((0,) * len(shape), shape, number, start + begin, nbytes)
    return TensorMeta(dtype_name(dtype), shape, "replicated", (chunk,))
