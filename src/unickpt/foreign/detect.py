"""Which format a load reads: a unickpt checkpoint, a safetensors model or a DCP folder."""

from __future__ import annotations

import os

from ..engine.commit import read_metadata
from ..errors import CheckpointNotFoundError
from ..format.metadata import Metadata
from ..storage.base import Storage
from ..storage.registry import open_storage
from .dequantizing import DequantizingStorage
from .safetensors_read import is_safetensors, read_safetensors

DCP_METADATA = ".metadata"
_FILE_SUFFIXES = (".safetensors", ".safetensors.index.json")


def split_source(path: str | os.PathLike[str] | Storage) -> tuple[Storage, str | None]:
    """The folder to read and the file in it a path names (a ``.safetensors`` file or a
    safetensors index), or None for a folder."""
    if isinstance(path, Storage):
        return path, None
    text = os.fspath(path).rstrip("/")
    if text.endswith(_FILE_SUFFIXES) and "/" in text:
        folder, name = text.rsplit("/", 1)
        return open_storage(folder or "/"), name
    if text.endswith(_FILE_SUFFIXES):
        return open_storage("."), text
    return open_storage(path), None


def read_any(storage: Storage, name: str | None, allow_pickle: bool = False) -> Metadata:
    """The metadata of what ``storage`` (or its file ``name``) holds: a committed unickpt
    checkpoint first (the same requests as before), then a safetensors model, then a DCP folder.
    A folder holding none of them raises the not-found error of a unickpt load. Through a
    :class:`DequantizingStorage`, as that storage translates it (float8 weights in blocks)."""
    meta = _read(storage, name, allow_pickle)
    if isinstance(storage, DequantizingStorage):
        return storage.translate(meta)
    return meta


def _read(storage: Storage, name: str | None, allow_pickle: bool) -> Metadata:
    if name is not None:
        return read_safetensors(storage, name)
    try:
        return read_metadata(storage)[1]
    except CheckpointNotFoundError:
        if is_safetensors(storage, None):
            return read_safetensors(storage)
        if storage.size(DCP_METADATA) is not None:
            from .dcp_read import read_dcp  # torch.distributed.checkpoint only when needed

            return read_dcp(storage, allow_pickle)
        raise
