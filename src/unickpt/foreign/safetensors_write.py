"""Save a sharded state straight into Hugging Face's safetensors layout, from every rank.

Every rank plans the same shard layout from the global plan (each tensor's global shape and
dtype): tensors in name order fill shards of about ``max_shard_size``; within a shard, larger
elements first, so each tensor is aligned. The coordinator creates each shard under a temporary
name at its final size with its header; then every rank writes the boxes the save planner gave
it (each stored box once, tied weights once) at their offsets, a box that is not a set of whole
rows as one run per row piece; once every rank is done, the coordinator puts the shards in
place and writes ``model.safetensors.index.json`` (a single shard is ``model.safetensors``, no
index) so that a model it replaces is never mixed with the new one (:func:`_commit`). Only
tensors are stored; other leaves are refused. Local folders only.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from ..dist import Comm, run_step
from ..engine.futures import SaveReport
from ..errors import CheckpointError, CheckpointExistsError
from ..format.dtypes import byte_view, dtype_from_name, itemsize
from ..layouts.boxes import Box
from ..planning.flatten import Flattened, KeyMap, flatten_state, rename_for_save
from ..planning.local_plan import local_plan
from ..planning.save_plan import GlobalPlan, build_global_plan
from ..storage.base import Storage
from ..storage.registry import is_local, local_path
from ..units import parse_size
from .common import DTYPE_NAMES
from .safetensors_commit import replace_model
from .safetensors_format import (
    INDEX_FILE,
    SINGLE_FILE,
    Entry,
    encode_header,
    order_entries,
    plan_shards,
    shard_name,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placed:
    """Where a tensor lies: its shard file and the byte offset of its first element."""

    file: str
    offset: int


@dataclass(frozen=True)
class ShardLayout:
    """The files of a save: each shard's name, header and size, and where each tensor lies."""

    names: tuple[str, ...]
    headers: tuple[bytes, ...]
    sizes: tuple[int, ...]
    placed: dict[str, Placed]
    total_bytes: int


def save_safetensors(
    path: str | os.PathLike[str] | Storage,
    state: dict[str, Any],
    comm: Comm,
    fmt: str,
    max_shard_size: int | str,
    overwrite: bool,
    config: Config,
    keys: KeyMap | None = None,
) -> SaveReport:
    """Write ``state``'s tensors as a Hugging Face safetensors model in folder ``path``.

    All ranks call it together; each writes the bytes the save planner gives it. ``keys``
    renames the state's keys to the tensor names written (see :func:`unickpt.save`).

    >>> unickpt.save("out/hf", {"model": model}, format="safetensors")  # doctest: +SKIP
    """
    if fmt != "safetensors":
        raise CheckpointError(
            f"format={fmt!r} is not a format unickpt saves; expected 'unickpt' (the default) "
            "or 'safetensors'."
        )
    if isinstance(path, Storage) or not is_local(path):
        raise CheckpointError(
            f"format='safetensors' writes to a local folder; got {path}. Save to a local (or "
            "shared file system) folder and copy it, or save in the unickpt format."
        )
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    folder = Path(local_path(path))
    t0 = time.perf_counter()

    def describe() -> tuple[Flattened, Any]:
        flat = rename_for_save(flatten_state(state), keys).flat
        _check_tensors_only(flat)
        return flat, (local_plan(flat).packed(), uuid.uuid4().hex[:12])

    flat, shared = run_step(comm, "planning the save", describe)
    plan = build_global_plan([p for p, _ in shared])
    layout = plan_layout(plan, limit)
    save_id = shared[0][1]
    temps = [f".{name}.tmp-{save_id}" for name in layout.names]

    def create() -> tuple[None, None]:
        if comm.is_coordinator:
            _create_files(folder, layout, temps, overwrite)
        return None, None

    run_step(comm, "creating the safetensors files", create)

    def write() -> tuple[int, None]:
        return _write_boxes(folder, flat, plan, layout, temps, comm.rank), None

    try:
        written, _ = run_step(comm, "writing the safetensors files", write)
        t1 = time.perf_counter()

        def commit() -> tuple[None, None]:
            if comm.is_coordinator:
                _commit(folder, layout, temps, save_id)
            return None, None

        run_step(comm, "committing the safetensors files", commit)
    except BaseException:
        if comm.is_coordinator:
            for temp in temps:
                (folder / temp).unlink(missing_ok=True)
        raise
    return SaveReport(written, t1 - t0, time.perf_counter() - t1, False)


def _check_tensors_only(flat: Flattened) -> None:
    others = sorted({*flat.values, *flat.per_rank})
    if others:
        shown = ", ".join(repr(k) for k in others[:5]) + (" ..." if len(others) > 5 else "")
        raise CheckpointError(
            f"format='safetensors' stores only tensors, but the state holds {len(others)} other "
            f"value(s): {shown}. Save those with unickpt.save (the default format), or leave "
            "them out of the state given here."
        )
    for key, leaf in flat.tensors.items():
        if leaf.dtype not in DTYPE_NAMES:
            raise CheckpointError(
                f"'{key}' is {leaf.dtype}, which safetensors cannot store; cast it to one of "
                f"{', '.join(str(d) for d in DTYPE_NAMES)}."
            )


def plan_layout(plan: GlobalPlan, max_shard_bytes: int) -> ShardLayout:
    """The shard files and each tensor's place in them, the same on every rank."""
    entries = []
    for key, (dtype_text, shape, _) in plan.tensors.items():
        dtype = dtype_from_name(dtype_text)
        entries.append(Entry(key, dtype, tuple(shape), math.prod(shape) * itemsize(dtype)))
    shards = plan_shards(entries, max_shard_bytes)
    count = len(shards)
    names, headers, sizes, placed = [], [], [], {}
    for i, shard in enumerate(shards):
        name = SINGLE_FILE if count == 1 else shard_name(i, count)
        ordered = order_entries(shard)
        header = encode_header(ordered, {"format": "pt"})
        offset = len(header)
        for e in ordered:
            placed[e.name] = Placed(name, offset)
            offset += e.nbytes
        names.append(name)
        headers.append(header)
        sizes.append(offset)
    total = sum(e.nbytes for e in entries)
    return ShardLayout(tuple(names), tuple(headers), tuple(sizes), placed, total)


def _create_files(folder: Path, layout: ShardLayout, temps: list[str], overwrite: bool) -> None:
    """The coordinator: refuse an existing model unless ``overwrite``, then create each shard
    under its temporary name, at its final size, with its header."""
    folder.mkdir(parents=True, exist_ok=True)
    existing = [n for n in (INDEX_FILE, SINGLE_FILE) if (folder / n).exists()]
    if existing and not overwrite:
        raise CheckpointExistsError(
            f"{folder} already holds a safetensors model ({existing[0]}); pass overwrite=True "
            "to replace it, or save to a new folder."
        )
    for temp, header, size in zip(temps, layout.headers, layout.sizes):
        with open(folder / temp, "wb") as f:
            f.write(header)
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())


def _write_boxes(
    folder: Path,
    flat: Flattened,
    plan: GlobalPlan,
    layout: ShardLayout,
    temps: list[str],
    rank: int,
) -> int:
    """Write the boxes ``rank`` stores at their offsets; the bytes written."""
    temp_of = dict(zip(layout.names, temps))
    views = {(k, b): v for k, t in flat.tensors.items() for b, v in t.pieces}
    fds: dict[str, int] = {}
    written = 0
    try:
        for key, box in plan.assigned(rank):
            place = layout.placed[key]
            fd = fds.get(place.file)
            if fd is None:
                fd = fds[place.file] = os.open(folder / temp_of[place.file], os.O_WRONLY)
            data = byte_view(views[(key, box)].detach().cpu().contiguous()).numpy()
            shape = plan.tensors[key][1]
            size = itemsize(dtype_from_name(plan.tensors[key][0]))
            source, done = memoryview(data.data), 0
            for start, length in row_major_runs(shape, box):
                run = source[done * size : (done + length) * size]
                _pwrite_all(fd, run, place.offset + start * size)
                done += length
            written += data.nbytes
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return written


def row_major_runs(shape: tuple[int, ...], box: Box) -> Iterator[tuple[int, int]]:
    """The contiguous runs of ``box`` in the row-major flattening of a tensor of ``shape``:
    ``(first element, elements)``, in the box's own row-major order.

    >>> list(row_major_runs((4, 6), Box((1, 2), (2, 3))))
    [(8, 3), (14, 3)]
    """
    ndim = len(shape)
    if box.numel == 0:
        return
    split = ndim  # dimensions from ``split`` on are whole: one run covers them
    while split > 0 and box.offsets[split - 1] == 0 and box.lengths[split - 1] == shape[split - 1]:
        split -= 1
    if split == 0:
        yield 0, box.numel
        return
    strides = [math.prod(shape[d + 1 :]) for d in range(ndim)]
    length = math.prod(box.lengths[split - 1 :])
    outer = [range(o, o + n) for o, n in zip(box.offsets[: split - 1], box.lengths[: split - 1])]
    base = box.offsets[split - 1] * strides[split - 1]
    for index in itertools.product(*outer):
        yield base + sum(i * s for i, s in zip(index, strides)), length


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _commit(folder: Path, layout: ShardLayout, temps: list[str], save_id: str) -> None:
    """The coordinator, once every rank wrote: the shards replace the folder's model."""
    weight_map = {k: p.file for k, p in sorted(layout.placed.items())}
    replace_model(folder, dict(zip(layout.names, temps)), weight_map, layout.total_bytes, save_id)
