"""The public functions: save, load, async_save.

All ranks of ``group`` (default: the world) call them together; in a single process no
process group is needed. A path is a local folder or a URL (``memory://...``, ``gs://...``;
see docs/storage.md), or a :class:`~unickpt.storage.base.Storage`.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook first
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .config import Config, get_config
from .dist import Comm
from .encoding.saving import check_quantize
from .engine import saver
from .engine.bounded import Stager
from .engine.compress import check_compress
from .engine.futures import SaveFuture
from .engine.hold import hold_steps
from .engine.incremental import IncrementalSave
from .engine.load import LoadReport
from .engine.load import load as _load
from .engine.references import resolving
from .engine.staging import ARENA, snapshot, stream_marker
from .engine.write import ItemSource
from .errors import CheckpointError
from .foreign.dequantizing import DequantizingStorage
from .foreign.detect import read_any, split_source
from .format.metadata import Metadata
from .layouts.rules import LayoutMap, applying
from .planning.capture import Capture, capture
from .planning.load_keys import KeyMap
from .planning.save_keys import StateKeys
from .storage.base import Storage
from .storage.registry import open_storage

log = logging.getLogger(__name__)

_PENDING: list[SaveFuture] = []
_PENDING_LOCK = threading.Lock()


def _finish_at_exit() -> None:
    """An interpreter that exits first still completes (or fails) its pending saves."""
    with _PENDING_LOCK:
        pending = [f for f in _PENDING if not f.done()]
    if pending:
        log.info("waiting for %d asynchronous save(s) before exiting", len(pending))
    wait_pending()


# Run before concurrent.futures stops accepting work at interpreter shutdown (its hook was
# registered at import, and these hooks run last-registered first).
_register = getattr(threading, "_register_atexit", atexit.register)
_register(_finish_at_exit)


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
) -> saver.SaveReport:
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
    wait_pending()
    cfg = config or get_config()
    comm = Comm(group, cfg.collective_timeout_s)
    if format != "unickpt":
        from .foreign.safetensors_write import save_safetensors

        return save_safetensors(path, state, comm, format, max_shard_size, overwrite, cfg, keys)
    storage = storage_for(path)
    quantized, compress = check_quantize(quantize), check_compress(compress)
    with applying(layout):
        prep = saver.prepare(
            comm, storage, state, allow_pickle, overwrite, quantized, lock, keys, config=cfg
        )
    prep.incremental, prep.compress = incremental, compress
    sources = [ItemSource(v) for v in prep.views]
    return saver.write_and_commit(prep, storage, sources, cfg, progress)


def async_save(
    path: str | os.PathLike[str] | Storage,
    state: dict[str, Any],
    *,
    group: Any = None,
    allow_pickle: bool = False,
    background_snapshot: bool = False,
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
) -> SaveFuture:
    """Snapshot ``state`` and return; write, fsync and commit go on in the background.

    With ``background_snapshot=True`` (zero-stall) the call returns at once: flattening,
    planning and the copy run in the background, overlapping forward and backward, and the
    checkpoint still holds exactly the values of the moment of the call, or nothing:

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

    ``staging_bytes`` bounds the host memory the snapshot takes (default: the config's
    ``staging_budget_bytes``, 16 GiB). A rank whose state is larger is copied through a ring of
    that many bytes (pinned when the state is on a GPU), each piece written before its room is
    reused: the snapshot is done, and the call returns (with ``background_snapshot``, the next
    optimizer step goes on), once all but about ``staging_bytes`` of the state is written.
    Saves with ``compress``, incremental saves and budgets below two checksum segments then
    write from the live tensors instead, and the call (the next step) waits for the whole
    write. See docs/async.md.

    >>> fut = unickpt.async_save("ckpt/step-100", state)  # doctest: +SKIP
    >>> ...  # train on
    >>> fut.wait()  # doctest: +SKIP
    """
    cfg = config or get_config()
    quantized, compress = check_quantize(quantize), check_compress(compress)
    budget = _staging_budget(staging_bytes, cfg)
    fut = SaveFuture()
    fut.path = str(path) if not isinstance(path, Storage) else path.location
    if background_snapshot:
        return _deferred_save(
            path,
            state,
            group,
            allow_pickle,
            overwrite,
            cfg,
            on_commit,
            fut,
            incremental,
            quantized,
            lock,
            layout,
            compress,
            budget,
            keys,
        )
    wait_pending()
    comm = Comm(group, cfg.collective_timeout_s)
    storage = storage_for(path)
    with applying(layout):
        prep = saver.prepare(
            comm, storage, state, allow_pickle, overwrite, quantized, lock, keys, config=cfg
        )
    prep.incremental, prep.compress = incremental, compress
    if prep.nbytes > budget and _can_stage(prep, budget, cfg):
        stager = Stager(prep.views, budget, ARENA, on_copied=fut.set_snapshot_done)
        _start(fut, lambda: _finish_staged(prep, storage, stager, cfg, on_commit, fut))
        stager.wait_copied()
        fut.blocking_s = time.perf_counter() - fut.started_s
        return fut
    if prep.nbytes > budget:
        log.info(
            "state (%d bytes) exceeds the staging budget; saving in the foreground", prep.nbytes
        )
        report = saver.write_and_commit(prep, storage, [ItemSource(v) for v in prep.views], cfg)
        if on_commit is not None:
            on_commit()
        fut.set_result(report)
        fut.blocking_s = time.perf_counter() - fut.started_s
        return fut
    check: Callable[[], None] | None = None
    try:
        sources = snapshot(prep.items, prep.views, ARENA, cfg.io_threads, intra_op=True)
    except Exception as e:  # noqa: BLE001 - fails the write on every rank (the others wait there)
        sources, check = [], _failing(e)
    except BaseException:
        if prep.release is not None:
            prep.release()
        raise
    fut.set_snapshot_done()

    def work() -> None:
        try:
            _finish(prep, storage, sources, cfg, on_commit, fut, check)
        except BaseException as e:  # noqa: BLE001 - handed to the caller through wait()
            fut.set_exception(e)

    _start(fut, work)
    return fut


def _deferred_save(
    path: str | os.PathLike[str] | Storage,
    state: dict[str, Any],
    group: Any,
    allow_pickle: bool,
    overwrite: bool,
    cfg: Config,
    on_commit: Callable[[], None] | None,
    fut: SaveFuture,
    incremental: IncrementalSave | None = None,
    quantize: dict[str, int] | None = None,
    lock: bool = True,
    layout: LayoutMap | None = None,
    compress: bool = False,
    budget: int | None = None,
    keys: KeyMap | None = None,
) -> SaveFuture:
    """Zero-stall: capture in the call; plan, copy and write in the background, while every
    optimizer step of the process waits for the copy."""
    budget = cfg.staging_budget_bytes if budget is None else budget
    comm = Comm(group, cfg.collective_timeout_s)  # may create a group: all ranks, this thread
    storage = storage_for(path)
    captured: Capture | None = None
    failed: BaseException | None = None
    try:
        captured = capture(state)
    except Exception as e:  # noqa: BLE001 - raised in the planning step, on every rank
        failed = e
    marker = stream_marker()  # CUDA: the copy starts after the caller's queued kernels
    hold_steps(fut)
    with _PENDING_LOCK:
        earlier = [f for f in _PENDING if not f.done()]

    def work() -> None:
        prep: saver.PreparedSave | None = None
        finishing = False
        try:
            for previous in earlier:  # one save at a time: they share the staging memory
                previous.wait_done()
            with applying(layout):
                prep = saver.prepare(
                    comm,
                    storage,
                    captured.state if captured is not None else {},
                    allow_pickle,
                    overwrite,
                    quantize,
                    lock,
                    keys,
                    failed,
                    config=cfg,
                )
            assert captured is not None  # else the planning step raised
            prep.incremental, prep.compress = incremental, compress
            if marker is not None:
                marker.synchronize()
            check: Callable[[], None] | None
            if prep.nbytes > budget and _can_stage(prep, budget, cfg):
                finishing = True  # the write releases the lock whatever happens
                stager = _checked_stager(prep, captured, budget, fut)
                _finish_staged(prep, storage, stager, cfg, on_commit, fut)
                return
            if prep.nbytes > budget:
                # Streamed from the live tensors: the steps wait for the whole write.
                sources = [ItemSource(v) for v in prep.views]
                check = _unchanged(prep, captured)
            else:
                sources, check = _checked_snapshot(prep, captured, cfg)
                fut.set_snapshot_done()
            finishing = True  # write_and_commit releases the lock whatever happens
            _finish(prep, storage, sources, cfg, on_commit, fut, check)
        except BaseException as e:  # noqa: BLE001 - handed to the caller through wait()
            if prep is not None and prep.release is not None and not finishing:
                prep.release()
            fut.set_exception(e)

    _start(fut, work)
    return fut


def _staging_budget(staging_bytes: int | None, cfg: Config) -> int:
    if staging_bytes is None:
        return cfg.staging_budget_bytes
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int):
        raise CheckpointError(
            f"staging_bytes is {staging_bytes!r}; expected a number of bytes (an int) or None "
            "for the config's staging_budget_bytes."
        )
    if staging_bytes < 2 * cfg.segment_bytes:
        raise CheckpointError(
            f"staging_bytes is {staging_bytes}; expected at least two checksum segments "
            f"({2 * cfg.segment_bytes} bytes). A budget of a few parts (64 MiB or more) keeps "
            "copies and writes overlapped."
        )
    return staging_bytes


def _can_stage(prep: saver.PreparedSave, budget: int, cfg: Config) -> bool:
    """Whether the save can go through a bounded ring: a plain full write (a compressed or
    incremental one reads each tensor more than once, or out of file order) and a ring of at
    least two checksum segments."""
    return not prep.compress and prep.incremental is None and budget >= 2 * cfg.segment_bytes


def _checked_stager(
    prep: saver.PreparedSave, captured: Capture, budget: int, fut: SaveFuture
) -> Stager:
    """A stager whose copies check each tensor unchanged since the call (zero-stall)."""

    def check(i: int) -> None:
        captured.check(prep.state_key(prep.items[i].key))

    return Stager(prep.views, budget, ARENA, check=check, on_copied=fut.set_snapshot_done)


def _finish_staged(
    prep: saver.PreparedSave,
    storage: Storage,
    stager: Stager,
    cfg: Config,
    on_commit: Callable[[], None] | None,
    fut: SaveFuture,
) -> None:
    """Write and commit through ``stager``; the snapshot is done whatever happens."""
    try:
        sources = [ItemSource(v) for v in prep.views]
        report = saver.write_and_commit(prep, storage, sources, cfg, stager=stager)
        if on_commit is not None:
            on_commit()
        fut.set_result(report)
    except BaseException as e:  # noqa: BLE001 - handed to the caller through wait()
        fut.set_exception(e)
    finally:
        stager.stop()


def _unchanged(prep: saver.PreparedSave, captured: Capture) -> Callable[[], None]:
    """A check that every tensor this rank writes still has its version of the call."""
    keys = [prep.state_key(i.key) for i in prep.items]
    return lambda: captured.check_all(keys)


def _checked_snapshot(
    prep: saver.PreparedSave, captured: Capture, cfg: Config
) -> tuple[list[ItemSource], Callable[[], None] | None]:
    """The snapshot, each tensor checked unchanged once copied. A failure becomes a check that
    fails the write, so that every rank learns of it and nothing is committed."""

    def check(i: int) -> None:
        captured.check(prep.state_key(prep.items[i].key))

    try:
        return snapshot(prep.items, prep.views, ARENA, cfg.io_threads, check), None
    except Exception as e:  # noqa: BLE001 - reported to every rank by the write
        return [], _failing(e)


def _failing(error: BaseException) -> Callable[[], None]:
    """A check that raises ``error``: a copy that failed on this rank fails the write, which
    every rank learns of (none waits for this one), and nothing is committed."""

    def fail() -> None:
        raise error

    return fail


def _finish(
    prep: saver.PreparedSave,
    storage: Storage,
    sources: list[ItemSource],
    cfg: Config,
    on_commit: Callable[[], None] | None,
    fut: SaveFuture,
    check: Callable[[], None] | None = None,
) -> None:
    report = saver.write_and_commit(prep, storage, sources, cfg, check=check)
    if on_commit is not None:
        on_commit()
    fut.set_result(report)


def _start(fut: SaveFuture, work: Callable[[], None]) -> None:
    def run() -> None:
        try:
            work()
        finally:  # a finished save leaves the list: later saves wait only for running ones
            with _PENDING_LOCK:
                if fut in _PENDING:
                    _PENDING.remove(fut)

    with _PENDING_LOCK:
        _PENDING[:] = [f for f in _PENDING if not f.done()]
        _PENDING.append(fut)
    # Not a daemon: an interpreter that exits joins it, so a save is never cut off midway.
    threading.Thread(target=run, name="unickpt-async-save", daemon=False).start()
    fut.blocking_s = time.perf_counter() - fut.started_s


def wait_pending() -> None:
    """Wait for every asynchronous save this process started (saves are ordered)."""
    with _PENDING_LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    for fut in pending:
        try:
            fut.wait()
        except Exception:
            log.debug("an earlier asynchronous save failed", exc_info=True)


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
