"""Import a ``torch.distributed.checkpoint`` (DCP) folder into a unickpt checkpoint.

DCP's own reader loads the tensors, a group of at most ``group_bytes`` at a time, into a
scratch file next to the destination (:class:`unickpt.tools.spool.Spool`); the save then reads
them memory-mapped. DCP pickles its ``.metadata``: it is read as plain data and what DCP
metadata holds (:mod:`unickpt.foreign.dcp_pickles`), and non-tensor entries, once their pickle
is found to be plain data, with ``torch.load(weights_only=True)``, unless pickle is allowed.
Either way, every file and byte range the metadata states is checked against the folder
(:func:`unickpt.foreign.dcp_checks.check_storage`) before torch's reader opens a file.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    UnsafeObjectError,
)
from ..foreign.dcp_checks import check_storage
from ..foreign.dcp_pickles import check_value_archive, load_dcp_metadata
from ..storage.registry import is_local, local_path
from .dcp_common import METADATA_FILE, nest_by_paths, single_process
from .imports import save_imported, with_prefix
from .output import check_distinct
from .progress import ProgressFn
from .reports import ConvertReport
from .spool import Spool

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_GROUP_BYTES = 256 * MiB


class _ValuePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries without pickle unless allowed."""

    def __init__(self, allow_pickle: bool) -> None:
        super().__init__(allow_partial_load=True)
        self.allow_pickle = allow_pickle

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if not self.allow_pickle:
            check_value_archive(value.getvalue(), f"'{fqn}' of the DCP checkpoint")
        try:
            obj = torch.load(value, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as e:
            raise UnsafeObjectError(
                f"'{fqn}' of the DCP checkpoint is an object torch.load(weights_only=True) "
                "refuses; if you trust the checkpoint, pass --allow-pickle (allow_pickle=True)."
            ) from e
        self.original_state_dict[fqn] = obj


def import_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    allow_pickle: bool = False,
    overwrite: bool = False,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    progress: ProgressFn | None = None,
) -> ConvertReport:
    """Save the DCP checkpoint in folder ``src`` as unickpt checkpoint ``dst``.

    The state ``dcp.save`` was given is rebuilt from DCP's recorded object paths (lists
    included) before it is saved, so ``unickpt.load(dst, state)`` fills a state of that
    structure.

    >>> import_dcp("dcp/step-100", "ckpt/step-100")  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    src_path = Path(src)
    check_distinct(src_path, dst)
    with dcp_contents(src_path, dst, allow_pickle, group_bytes, progress) as (flat, meta):
        state = with_prefix(nest_by_paths(flat, meta.planner_data), prefix, src_path)
        return save_imported(
            state,
            src_path,
            dst,
            "dcp",
            allow_pickle=allow_pickle,
            overwrite=overwrite,
            started_s=t0,
            progress=_half(progress, 1, _tensor_bytes(meta)),
        )


@contextmanager
def dcp_contents(
    src: Path,
    dst: str | os.PathLike[str],
    allow_pickle: bool,
    group_bytes: int,
    progress: ProgressFn | None,
) -> Iterator[tuple[dict[str, Any], Metadata]]:
    """Every entry of the DCP folder ``src`` by its DCP key, with its metadata; tensors are
    spooled to a scratch file beside a local ``dst`` (the same disk, which has room for the
    checkpoint; the system's temporary folder for a URL) that lives as long as the context."""
    meta = read_dcp_metadata(src, allow_pickle)
    tensors = {
        k: m for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)
    }
    value_keys = [
        k for k, m in meta.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)
    ]
    values = _load_values(src, value_keys, allow_pickle)
    with tempfile.TemporaryDirectory(prefix=".unickpt-import.", dir=_scratch_dir(dst)) as scratch:
        spool = Spool(Path(scratch) / "tensors.bin")
        scale = _tensor_bytes(meta)
        _spool_tensors(src, tensors, spool, group_bytes, _half(progress, 0, scale), allow_pickle)
        yield {**spool.tensors(), **values}, meta


def _scratch_dir(dst: str | os.PathLike[str]) -> str | None:
    if not is_local(dst):
        return None
    parent = Path(local_path(dst)).absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    return str(parent)


def _tensor_bytes(meta: Metadata) -> int:
    items = meta.state_dict_metadata.values()
    return sum(_nbytes(m) for m in items if isinstance(m, TensorStorageMetadata))


def _half(progress: ProgressFn | None, which: int, scale: int) -> ProgressFn | None:
    """Reading into the spool is the first half of the bar, the save the second; both halves
    count ``scale`` bytes (the tensors' bytes), whatever total the step reports."""
    if progress is None:
        return None

    def report(done: int, total: int) -> None:
        part = done if total == scale else (done * scale // total if total else scale)
        progress(which * scale + part, 2 * scale)

    return report


class SafeReader(FileSystemReader):
    """DCP's file system reader, reading ``.metadata`` as plain data and what DCP metadata
    holds (:mod:`unickpt.foreign.dcp_pickles`) unless pickle is allowed, and refusing metadata
    whose files and byte ranges are not of the folder (:func:`check_storage`) either way."""

    def __init__(self, path: Path, allow_pickle: bool) -> None:
        super().__init__(path)
        self.allow_pickle = allow_pickle

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        folder = Path(self.path)
        if self.allow_pickle:
            meta = super().read_metadata(*args, **kwargs)
        else:
            path = folder / METADATA_FILE
            meta = load_dcp_metadata(path.read_bytes(), str(path))
        check_storage(meta, lambda name: _size(folder / name), str(folder))
        if not self.allow_pickle:
            storage = getattr(meta, "storage_meta", None) or StorageMeta()
            storage.load_id = self.load_id
            meta.storage_meta = storage
        return meta


def _size(path: Path) -> int | None:
    return path.stat().st_size if path.is_file() else None


def read_dcp_metadata(src: Path, allow_pickle: bool = False) -> Metadata:
    """The metadata of DCP folder ``src``, unpickled with only the classes DCP metadata holds
    unless ``allow_pickle``."""
    if not (src / METADATA_FILE).is_file():
        raise CheckpointNotFoundError(
            f"{src} is not a DCP checkpoint: it has no .metadata file (dcp.save writes one)."
        )
    try:
        return SafeReader(src, allow_pickle).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{src}/.metadata could not be read ({e}); it is damaged.") from e


def _load_values(src: Path, keys: list[str], allow_pickle: bool) -> dict[str, Any]:
    if not keys:
        return {}
    state: dict[str, Any] = dict.fromkeys(keys)
    with single_process(_damaged(src), CheckpointCorruptError):
        reader = SafeReader(src, allow_pickle)
        dcp.load(state, storage_reader=reader, planner=_ValuePlanner(allow_pickle), no_dist=True)
    return state


def _damaged(src: Path) -> str:
    return f"{src} could not be read by DCP; the checkpoint is damaged or incomplete"


def _groups(
    tensors: dict[str, TensorStorageMetadata], group_bytes: int
) -> Iterator[list[tuple[str, TensorStorageMetadata]]]:
    group: list[tuple[str, TensorStorageMetadata]] = []
    size = 0
    for key, m in tensors.items():
        nbytes = _nbytes(m)
        if group and size + nbytes > group_bytes:
            yield group
            group, size = [], 0
        group.append((key, m))
        size += nbytes
    if group:
        yield group


def _nbytes(m: TensorStorageMetadata) -> int:
    return m.size.numel() * m.properties.dtype.itemsize


def _spool_tensors(
    src: Path,
    tensors: dict[str, TensorStorageMetadata],
    spool: Spool,
    group_bytes: int,
    progress: ProgressFn | None,
    allow_pickle: bool,
) -> None:
    total = sum(_nbytes(m) for m in tensors.values())
    done = 0
    for group in _groups(tensors, group_bytes):
        part = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in group}
        planner = DefaultLoadPlanner(allow_partial_load=True)
        with single_process(_damaged(src), CheckpointCorruptError):
            reader = SafeReader(src, allow_pickle)
            dcp.load(part, storage_reader=reader, planner=planner, no_dist=True)
        for key, tensor in part.items():
            spool.add(key, tensor)
            done += tensor.numel() * tensor.element_size()
        del part
        if progress is not None:
            progress(done, total)
        log.debug("read %d tensors from %s", len(group), src)
