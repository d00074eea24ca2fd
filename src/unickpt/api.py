"""The public functions: save, async_save, load, prepare_staging.

All ranks of ``group`` (default: the world) call them together; in a single process no
process group is needed. A path is a local folder or a URL (``memory://...``, ``gs://...``;
see docs/storage.md), or a :class:`~unickpt.storage.base.Storage`. A save is run by
:mod:`unickpt.saving.pipeline`, in the process's save queue (see docs/async.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .config import Config, get_config
from .dist import Comm
from .encoding.saving import check_quantize
from .engine.compress import check_compress
from .engine.futures import SaveFuture, SaveReport
from .engine.incremental import IncrementalSave
from .engine.load import LoadReport
from .engine.load import load as _load
from .engine.references import resolving
from .foreign.dequantizing import DequantizingStorage
from .foreign.detect import read_any, split_source
from .format.metadata import Metadata
from .layouts.rules import LayoutMap, applying
from .planning.load_keys import KeyMap, StateKeys
from .saving import pipeline
from .saving.queue import QUEUE
from .saving.save import Save, SaveOptions
from .storage.base import Storage
from .storage.registry import open_storage

log = logging.getLogger(__name__)


def storage_for(path: str | os.PathLike[str] | Storage) -> Storage:
    """The storage backend for a path or URL (see :func:`open_storage`), or a ready-made one."""
    return open_storage(path)


def save(
    path: str | os.PathLike[str] | Storage,
    state: dict[str, Any],
    *,
    group: Any = None,
    allow_pickle: bool = False,
    overwrite: bool = False,
    config: Config | None = None,
    progress: Callable[[int, int], None] | None = None,
    incremental: IncrementalSave | None = None,
    quantize: Mapping[str, int] | None = None,
    lock: bool = True,
    compress: bool = False,
    format: str = "unickpt",
    max_shard_size: int | str = "5GB",
    layout: LayoutMap | None = None,
    keys: KeyMap | None = None,
) -> SaveReport:
    """Save ``state`` to ``path``; durable and committed when it returns.

    ``format="safetensors"`` writes Hugging Face's layout instead (shards of about
    ``max_shard_size`` and ``model.safetensors.index.json``, as ``save_pretrained``), every
    rank writing the bytes it holds straight into the shards; only tensors (see
    :func:`unickpt.foreign.safetensors_write.save_safetensors`, docs/formats.md).

    ``progress(bytes_written, bytes_total)``, when given, is called on every rank as pieces of
    its data file land (a progress bar for long saves). ``incremental`` is how a
    :class:`~unickpt.Checkpointer` with ``incremental=True`` skips unchanged chunks.

    ``compress=True`` stores chunks losslessly compressed (bytes grouped per element, then
    zstd, per checksum segment; needs ``zstandard``); see docs/format.md.

    ``quantize`` maps 2-D floating tables (embedding weights) to 8 or 4: they are stored with
    per-row asymmetric uniform codes of that many bits and a float32 scale and minimum per row
    (never by default; lossy). Loads decode them; the report's ``encoding_errors`` says what
    quantization changed (``{"model.emb.weight": 8}``).

    ``layout`` maps patterns of flattened keys to functions that wrap the tensor found there
    (``{"*.linear_fc1.weight": unickpt.fused_glu(tp_rank, tp_size)}``: fused, padded and
    replicated tensors, see docs/layouts.md); load with the same map.

    ``keys`` renames the state's keys to the saved ones, for every format: a dict (keys it
    lacks keep their name) or a function from state key to saved key (None keeps the name).
    ``keys=lambda k: k.removeprefix("model.")`` saves ``{"model": model}`` under the names a
    Hugging Face model's ``from_pretrained`` reads; :func:`load` takes the inverse
    (``keys=lambda k: "model." + k``). ``quantize`` and ``row_deltas`` name saved keys,
    ``layout`` the state's.

    >>> import torch, unickpt
    >>> model = torch.nn.Linear(4, 2)
    >>> unickpt.save("/tmp/unickpt-doc/ckpt", {"model": model}, overwrite=True)  # doctest: +SKIP
    >>> unickpt.load("/tmp/unickpt-doc/ckpt", {"model": model})  # doctest: +SKIP
    """
    cfg = config or get_config()
    if format != "unickpt":
        from .foreign.safetensors_write import save_safetensors

        comm = Comm(group, cfg.collective_timeout_s)
        with QUEUE.turn():
            return save_safetensors(path, state, comm, format, max_shard_size, overwrite, cfg, keys)
    options = SaveOptions(
        allow_pickle,
        overwrite,
        check_quantize(quantize),
        check_compress(compress),
        lock,
        layout,
        keys,
        incremental=incremental,
        progress=progress,
    )
    fut = pipeline.run(Save(storage_for(path), group, cfg, options), state, "sync")
    report: SaveReport = fut.wait()
    return report


def async_save(
    path: str | os.PathLike[str] | Storage,
    state: dict[str, Any],
    *,
    group: Any = None,
    allow_pickle: bool = False,
    zero_stall: bool = False,
    overwrite: bool = False,
    config: Config | None = None,
    on_commit: Callable[[], None] | None = None,
    incremental: IncrementalSave | None = None,
    quantize: Mapping[str, int] | None = None,
    lock: bool = True,
    layout: LayoutMap | None = None,
    compress: bool = False,
    staging_bytes: int | None = None,
    keys: KeyMap | None = None,
    background_snapshot: bool | None = None,
) -> SaveFuture:
    """Snapshot ``state`` and return; write, fsync and commit go on in the background.

    With ``zero_stall=True`` the call returns at once: flattening, planning and the copy run
    in the background, overlapping forward and backward, and the checkpoint still holds
    exactly the values of the moment of the call, or nothing:

    - in the call, the containers of ``state`` and the state dicts of its stateful objects
      (modules, optimizers, data loaders, your trainer) are taken, and the tensors that may
      change before the next optimizer step are copied: module buffers (BatchNorm statistics
      change in the next forward), plain tensors of at most 64 KiB, and tensors without a
      version counter (inference mode); other values are deep-copied;
    - every optimizer step of the process (any ``torch.optim.Optimizer``, wherever it sits)
      waits until the copy is done;
    - any other in-place change, between the call and the end of its copy, to a tensor kept by
      reference moves its version counter and fails the save: ``wait()`` raises a
      :class:`CheckpointError` naming the key, and nothing is committed at ``path`` (with
      ``overwrite=True`` the previous checkpoint there stays).

    Writes that bypass version counters (through ``tensor.data``, NumPy views, raw storage)
    cannot be seen; make them after ``fut.wait_snapshot()``. Errors of planning (an existing
    checkpoint, an unpicklable value) surface in ``wait()``. ``on_commit`` runs on every rank,
    in the background, once the checkpoint is committed (retention and replication hook in
    there). ``quantize``, ``lock``, ``layout`` and ``keys`` are as for :func:`save`.
    ``background_snapshot`` is the former name of ``zero_stall`` (deprecated).

    ``staging_bytes`` bounds the host memory the snapshot takes (default: the config's
    ``staging_budget_bytes``, 16 GiB). A rank whose state is larger is copied through a ring of
    that many bytes (pinned when the state is on a GPU), each piece written before its room is
    reused: the snapshot is done, and the call returns (zero-stall: the next optimizer step
    goes on), once all but about ``staging_bytes`` of the state is written.
    Saves with ``compress``, incremental saves and budgets below two checksum segments then
    write from the live tensors instead, and the call (the next step) waits for the whole
    write. Saves from several threads run one after another, in the order of their calls;
    see docs/async.md.

    >>> fut = unickpt.async_save("ckpt/step-100", state)  # doctest: +SKIP
    >>> ...  # train on
    >>> fut.wait()  # doctest: +SKIP
    """
    if background_snapshot is not None:
        warnings.warn(
            "async_save(background_snapshot=...) is deprecated; pass zero_stall=... instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        zero_stall = zero_stall or background_snapshot
    cfg = config or get_config()
    options = SaveOptions(
        allow_pickle,
        overwrite,
        check_quantize(quantize),
        check_compress(compress),
        lock,
        layout,
        keys,
        staging_bytes,
        incremental,
        on_commit,
    )
    save = Save(storage_for(path), group, cfg, options)
    return pipeline.run(save, state, "zero_stall" if zero_stall else "async")


def prepare_staging(
    state: dict[str, Any],
    *,
    staging_bytes: int | None = None,
    config: Config | None = None,
    layout: LayoutMap | None = None,
) -> SaveFuture:
    """Allocate, in the background, the host memory an asynchronous save of ``state`` copies
    into (pinned when the state is on a GPU), so that the first save costs what later ones do.

    Takes at most ``staging_bytes`` (default: the config's ``staging_budget_bytes``); each
    rank calls it alone, no collective. ``wait()`` returns the bytes held. A save called
    meanwhile waits for the allocation. See docs/async.md.

    >>> unickpt.prepare_staging(state)  # doctest: +SKIP
    >>> ...  # the first steps of training
    >>> unickpt.async_save("ckpt/step-100", state)  # doctest: +SKIP
    """
    return pipeline.prepare_staging(state, config or get_config(), staging_bytes, layout)


def wait_pending() -> None:
    """Wait for every asynchronous save this process started (saves are ordered)."""
    QUEUE.wait_all()


def load(
    path: str | os.PathLike[str] | Storage,
    state: dict[str, Any],
    *,
    group: Any = None,
    strict: bool = True,
    allow_pickle: bool = False,
    verify: bool | None = None,
    config: Config | None = None,
    keys: KeyMap | StateKeys | None = None,
    layout: LayoutMap | None = None,
    dequantize: bool | tuple[int, int] = False,
) -> LoadReport:
    """Load the checkpoint at ``path`` into ``state`` in place, resharding as needed.

    ``path`` may also hold a Hugging Face safetensors model (a folder with
    ``model.safetensors`` or ``model.safetensors.index.json``, or that file) or a
    ``torch.distributed.checkpoint`` folder: each rank reads the bytes of what it holds, without
    checksums to verify (``LoadReport.unverified_files``). ``keys`` renames saved keys to the
    state's: a dict, or a function from saved key to state key (None keeps the name), e.g.
    ``keys=lambda k: "model." + k`` to load a Hugging Face model into ``{"model": model}``.

    Tensors in ``state`` are filled, other leaves replaced, stateful objects (modules,
    optimizers, schedulers, anything with ``load_state_dict``) get their loaded state.
    ``strict=True`` (the default) requires every key of ``state`` in the checkpoint and, under
    each top-level key of ``state``, no extra saved key: loading ``{"model": model}`` from a
    checkpoint that also holds an optimizer is fine, a missing or unknown weight is not.
    ``strict=False`` loads the keys both have and warns about the others. ``verify=False``
    skips checksum verification. ``layout`` is as for :func:`save`.

    ``dequantize=True`` loads the float8 weights of a safetensors model stored in blocks with
    scales (``X.weight`` beside ``X.weight_scale_inv``, one float32 scale per block, as
    DeepSeek-V3) into the state's dtype (bfloat16, float16, float32): each value is the code
    times the scale of its block, and each rank reads the rows it holds and their scales only.
    The block size comes from the model's ``config.json`` (``weight_block_size``), else 128 x
    128; ``dequantize=(rows, cols)`` gives it. The scales' keys are then no keys of the
    checkpoint. Without it, loading such weights into a float state is refused (see
    docs/formats.md).

    >>> unickpt.load("hf/deepseek", {"model": model}, dequantize=True)  # doctest: +SKIP
    """
    wait_pending()
    cfg = config or get_config()
    if verify is not None and verify != cfg.verify:
        cfg = dataclasses.replace(cfg, verify=verify)
    comm = Comm(group, cfg.collective_timeout_s)
    folder, name = split_source(path)
    storage = DequantizingStorage(resolving(folder), dequantize, state, keys, strict)

    def read_meta(where: Storage) -> Metadata:
        return read_any(where, name, allow_pickle)

    try:
        with applying(layout):
            return _load(comm, storage, state, strict, allow_pickle, cfg, keys, read_meta)
    finally:
        storage.close()
