"""Export a checkpoint to safetensors: one file, or Hugging Face shards with an index.

Tensors stream out block by block (see :mod:`unickpt.tools.blocks`), so memory stays bounded
whatever the size of the checkpoint or of its largest tensor.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from ..engine.tensor_reader import CheckpointReader
from ..foreign.safetensors_commit import replace_model
from ..foreign.safetensors_format import (
    DTYPE_NAMES,
    INDEX_FILE,
    SINGLE_FILE,
    Entry,
    encode_header,
    order_entries,
    plan_shards,
    shard_name,
)
from ..format.dtypes import dtype_from_name
from ..layouts.boxes import Box
from ..storage.base import Storage
from .blocks import DEFAULT_BLOCK_BYTES, stream_tensor
from .output import atomic_file, check_distinct, fsync_file, prepare_folder, remove_files
from .progress import ProgressFn
from .reports import ConvertReport
from .selection import select_keys
from .values import warn_left_out

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def export_safetensors(
    src: str | os.PathLike[str] | Storage,
    dst: str | os.PathLike[str],
    *,
    only: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    verify: bool = True,
    untie: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: ProgressFn | None = None,
) -> ConvertReport:
    """Write the tensors of checkpoint ``src`` as safetensors with dotted keys.

    ``dst`` ending in ``.safetensors`` is one file. Otherwise ``dst`` is a folder that gets
    ``model.safetensors``, or, above ``max_shard_bytes``, ``model-0000i-of-0000n.safetensors``
    shards and ``model.safetensors.index.json``. ``only="model"`` writes the ``model``
    subtree with its prefix removed. Python values are left out (safetensors holds tensors).
    Tied weights are written once, under the key the state held them first (as Hugging Face's
    ``save_pretrained`` keeps ``wte.weight`` and drops ``lm_head.weight``; ``from_pretrained``
    ties them again); the report's ``tied`` names them. ``untie=True`` writes every name, each
    with its own copy.

    ``src`` is a checkpoint at any path or URL (or a Storage); ``verify=False`` reads it without
    checking its checksums. ``dst`` is a local path.

    >>> export_safetensors("ckpt/step-100", "hf-out", only="model")  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    dst_path = Path(dst)
    check_distinct(src, dst_path)
    with CheckpointReader(src, verify=verify) as reader:
        selection = select_keys(reader.metadata, only)
        tensors = dict(selection.tensors)
        if untie:
            tensors.update({n: selection.tensors[t] for n, t in selection.aliases.items()})
        tied = () if untie else tuple(sorted(selection.aliases.items()))
        entries, keys, left_out = _entries(reader, tensors)
        left_out += [
            f"{k}: not a tensor (safetensors stores tensors only)"
            for k in selection.values.values()
        ]
        writer = _Writer(reader, keys, block_bytes, progress, sum(e.nbytes for e in entries))

        def warn() -> None:  # once the destination is known to take the export
            warn_left_out(left_out, "safetensors export")
            _warn_mixed(list(keys.values()), only)
            for name, target in tied:
                log.info("'%s' is tied to '%s': written once, under '%s'", name, target, target)

        if dst_path.suffix == ".safetensors":
            with atomic_file(dst_path, overwrite) as tmp:
                warn()
                writer.write_file(tmp, entries)
            files = [dst_path]
        else:
            old = [dst_path / SINGLE_FILE, dst_path / INDEX_FILE]
            old += dst_path.glob("model-*-of-*.safetensors")
            prepare_folder(dst_path, old, overwrite, "safetensors export")
            warn()
            files = _write_folder(writer, dst_path, entries, max_shard_bytes)
    return ConvertReport(
        reader.storage.location,
        str(dst_path),
        "safetensors",
        tuple(str(f) for f in files),
        len(entries),
        0,
        writer.total,
        tuple(left_out),
        time.perf_counter() - t0,
        tied,
    )


def _entries(
    reader: CheckpointReader, tensors: dict[str, str]
) -> tuple[list[Entry], dict[str, str], list[str]]:
    entries, keys, left_out = [], {}, []
    for name, key in tensors.items():
        meta = reader.metadata.tensors[key]
        dtype = dtype_from_name(meta.value_dtype)
        if dtype not in DTYPE_NAMES:
            left_out.append(f"{key}: dtype {meta.value_dtype} has no safetensors name")
            continue
        nbytes = Box.whole(meta.value_shape).numel * dtype.itemsize
        entries.append(Entry(name, dtype, tuple(meta.value_shape), nbytes))
        keys[name] = key
    return entries, keys, left_out


def _warn_mixed(keys: list[str], only: str | None) -> None:
    """Warn when the export mixes the tensors of several top-level keys (a model's weights and
    an optimizer's moments in one model.safetensors, which from_pretrained does not read)."""
    tops = sorted({k.split(".", 1)[0] for k in keys})
    if only is not None or len(tops) < 2:
        return
    model = "model" if "model" in tops else tops[0]
    log.warning(
        "the export holds the tensors of %d top-level keys (%s) in one safetensors model: "
        "optimizer moments and other state beside the weights, which from_pretrained does not "
        "expect; pass --only %s (only=%r) to export one of them, its prefix removed",
        len(tops),
        ", ".join(tops),
        model,
        model,
    )


def _write_folder(
    writer: _Writer, dst: Path, entries: list[Entry], max_shard_bytes: int
) -> list[Path]:
    """One file or shards plus an index in ``dst`` (made by :func:`prepare_folder`), written
    under scratch names, then put in place of an earlier export so that a crash leaves one of
    them whole (:func:`~unickpt.foreign.safetensors_commit.replace_model`)."""
    shards = plan_shards(entries, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [shard_name(i, n) for i in range(n)]
    tag = uuid.uuid4().hex[:8]
    scratch = {name: f".{name}.{tag}.tmp" for name in names}
    try:
        for name, shard in zip(names, shards):
            writer.write_file(dst / scratch[name], shard)
            fsync_file(dst / scratch[name])
        weight_map = {e.name: name for name, shard in zip(names, shards) for e in shard}
        replace_model(dst, scratch, weight_map, writer.total, tag)
    finally:
        remove_files(dst / s for s in scratch.values())
    return [dst / name for name in names] + ([dst / INDEX_FILE] if n > 1 else [])


class _Writer:
    """Writes safetensors files from the checkpoint, one block at a time."""

    def __init__(
        self,
        reader: CheckpointReader,
        keys: dict[str, str],
        block_bytes: int,
        progress: ProgressFn | None,
        total: int,
    ) -> None:
        self.reader = reader
        self.keys = keys
        self.block_bytes = block_bytes
        self.progress = progress
        self.total = total
        self.done = 0

    def _advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.progress is not None:
            self.progress(self.done, self.total)

    def write_file(self, path: Path, entries: list[Entry]) -> None:
        ordered = order_entries(entries)
        with open(path, "wb") as f:
            f.write(encode_header(ordered, {"format": "pt"}))
            for e in ordered:
                stream_tensor(
                    self.reader, self.keys[e.name], f.write, self.block_bytes, self._advance
                )
        log.debug("wrote %d tensors into %s", len(entries), path)
