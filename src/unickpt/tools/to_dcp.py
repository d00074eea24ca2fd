"""Export a checkpoint to a ``torch.distributed.checkpoint`` (DCP) folder, in one process.

DCP's own :class:`FileSystemWriter` writes the folder. The state handed to ``dcp.save`` holds
meta tensors (shape and dtype only); the planner reads each tensor from the checkpoint when
the writer asks for it, and the writer puts one tensor per file, so memory holds the tensor
being written and, until the next is read, the one before it.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ..engine.tensor_reader import CheckpointReader
from ..format.dtypes import dtype_from_name
from ..storage.base import Storage
from .blocks import tensor_nbytes
from .dcp_common import METADATA_FILE, single_process
from .output import check_distinct, prepare_folder, remove_files
from .progress import ProgressFn
from .reports import ConvertReport
from .selection import nest_top_level, select_keys
from .values import decode_values, warn_left_out

log = logging.getLogger(__name__)


class _CheckpointSavePlanner(DefaultSavePlanner):
    """DCP's default planner, except that tensors come from the checkpoint when written."""

    def __init__(
        self, reader: CheckpointReader, keys: dict[int, str], progress: ProgressFn | None
    ) -> None:
        super().__init__()
        self.reader = reader
        self.keys = keys
        self.progress = progress
        self.total = sum(tensor_nbytes(reader, k) for k in keys.values())
        self.done = 0

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        obj = self.lookup_object(write_item.index)
        key = self.keys.get(id(obj)) if write_item.type != WriteItemType.BYTE_IO else None
        if key is None:
            return super().resolve_data(write_item)
        tensor = self.reader.read_tensor(key)
        self.done += tensor.numel() * tensor.element_size()
        if self.progress is not None:
            self.progress(self.done, self.total)
        return tensor


def export_dcp(
    src: str | os.PathLike[str] | Storage,
    dst: str | os.PathLike[str],
    *,
    only: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    progress: ProgressFn | None = None,
) -> ConvertReport:
    """Write checkpoint ``src`` as a DCP folder that ``dcp.load`` reads without a process group.

    The state has the nesting of :func:`unickpt.tools.export_torch` (dotted keys grouped by
    their first component; ``only`` selects a subtree), so DCP's keys are the checkpoint's
    dotted keys. Values saved with pickle are left out.

    ``src`` is a checkpoint at any path or URL (or a Storage); ``verify=False`` reads it without
    checking its checksums. ``dst`` is a local path.

    >>> export_dcp("ckpt/step-100", "dcp-out")  # doctest: +SKIP
    >>> import torch.distributed.checkpoint as dcp  # doctest: +SKIP
    >>> dcp.load(state, checkpoint_id="dcp-out")  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    dst_path = Path(dst)
    check_distinct(src, dst_path)
    with CheckpointReader(src, verify=verify) as reader:
        selection = select_keys(reader.metadata, only)
        values, left_out = decode_values(reader, selection)
        warn_left_out(left_out, "DCP export")
        flat: dict[str, Any] = {}
        keys: dict[int, str] = {}
        # DCP keeps every name of tied weights, each with its own copy
        tied = {name: selection.tensors[t] for name, t in selection.aliases.items()}
        for name, key in {**selection.tensors, **tied}.items():
            meta = reader.metadata.tensor(key)
            assert meta is not None
            t = torch.empty(
                meta.value_shape, dtype=dtype_from_name(meta.value_dtype), device="meta"
            )
            flat[name] = t
            keys[id(t)] = key
        flat.update(values)
        flat = dict(sorted(flat.items()))
        state = flat if only else nest_top_level(flat)
        planner = _CheckpointSavePlanner(reader, keys, progress)
        files = _save_into(dst_path, state, planner, overwrite)
    return ConvertReport(
        reader.storage.location,
        str(dst_path),
        "dcp",
        tuple(str(f) for f in files),
        len(keys),
        len(values),
        planner.total,
        tuple(left_out),
        time.perf_counter() - t0,
    )


def _save_into(
    dst: Path, state: dict[str, Any], planner: _CheckpointSavePlanner, overwrite: bool
) -> list[Path]:
    """``dcp.save`` into a scratch folder next to ``dst``, then move the files into ``dst``
    (``.metadata`` last), replacing an earlier DCP checkpoint there only when ``overwrite``."""
    old = [dst / METADATA_FILE, *dst.glob("*.distcp")]
    stale = prepare_folder(dst, old, overwrite, "DCP checkpoint")
    scratch = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    try:
        writer = FileSystemWriter(scratch, single_file_per_rank=False, overwrite=True)
        with single_process(f"writing the DCP checkpoint {dst} failed"):
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        remove_files(stale)
        written = sorted(scratch.iterdir(), key=lambda p: (p.name == METADATA_FILE, p.name))
        for p in written:
            os.replace(p, dst / p.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return [dst / p.name for p in written]
