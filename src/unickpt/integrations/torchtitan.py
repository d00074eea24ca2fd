"""torchtitan: a checkpoint manager that saves and loads through unickpt.

The one-line switch, in a torchtitan ``Trainer.Config``, keeping every setting of the config's
own checkpoint section (a registry config's ``interval``, ``last_save_model_only``...)::

    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    config.checkpoint = UnickptCheckpointManager.Config.from_config(
        config.checkpoint, enable=True, async_mode="async"
    )

The trainer then builds this manager where it would build its DCP one. It logs as torchtitan
does (``Saving the checkpoint (step N) to ...``, ``Finished saving the checkpoint in ...``,
``Loading the checkpoint from ...``, ``Finished loading the checkpoint in ...``). What it maps:

- ``model``: the model parts' state dicts merged (FSDP2/TP DTensors reshard on load);
- ``optimizer``: the optimizers container's own flat, FQN-keyed state dict;
- ``lr_scheduler``, ``train_state`` and any other state the trainer passes: their state dicts;
- ``dataloader``: each rank's own state, as a :class:`unickpt.PerRank` value (its keys,
  ``dp_rank_N``, differ between ranks), which reshards on another number of processes
  (:mod:`unickpt.data.titan`: a map-style Hugging Face text dataset resumes with every document
  of the epoch read once; other data loaders are refused, naming ``exclude_from_loading``);
- ``folder`` (under the dump folder) is a :class:`unickpt.Checkpointer` root, ``keep_latest_k``
  its ``keep_last`` (0: keep all), ``async_mode`` ``"disabled"`` a synchronous save, ``"async"``
  an asynchronous one (returns after the snapshot), ``"async_with_pinned_mem"`` a zero-stall one
  (``mode="zero_stall"``: the snapshot overlaps the next forward and backward and
  ``maybe_wait_for_staging``, or the next optimizer step, waits for it).

With the train spec's state dict adapter, ``initial_load_in_hf`` loads the model from a Hugging
Face safetensors folder or URL (``initial_load_path``) through ``to_hf``/``from_hf``, each rank
reading what it holds, and ``last_save_in_hf`` writes the last save's model as safetensors
(``step-000000100-hf``) from every rank.

Checkpoints are unickpt checkpoints (``step-000000100``): ``unickpt inspect``, ``convert``
and ``load`` read them. Loading into another world size or layout works for everything; the
data loader's position reshards where :mod:`unickpt.data.titan` can split it exactly, and is
refused otherwise (list ``"dataloader"`` in ``exclude_from_loading`` to start the data over).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from .. import api
from ..checkpointer import Checkpointer
from ..config import get_config
from ..data.titan import TitanLoaderState
from ..dist import Comm, decide
from ..engine.futures import SaveFuture
from ..errors import CheckpointError, CheckpointNotFoundError
from . import StatefulView

log = logging.getLogger(__name__)

_MODES = {"disabled": "sync", "async": "async", "async_with_pinned_mem": "zero_stall"}
"""torchtitan's ``async_mode`` as a Checkpointer's ``mode``."""

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
_IN_HF = "initial_load_in_hf"


class ModelParts:
    """The state dicts of the model parts (pipeline stages) merged into one; loaded in place."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return {k: v for part in self.parts for k, v in part.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            own = part.state_dict()
            part.load_state_dict({k: v for k, v in state_dict.items() if k in own})


class UnickptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager interface on a :class:`unickpt.Checkpointer`.

    Built by the trainer from :class:`UnickptCheckpointManager.Config` with the same keyword
    arguments as torchtitan's ``CheckpointManager``; every rank builds it and calls ``save``,
    ``load``, the waits and ``close`` together.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``disabled``: save in the call; ``async``: return after the snapshot;
        ``async_with_pinned_mem``: return at once, the snapshot overlapping the next step."""

        def __post_init__(self) -> None:
            # torchtitan's own checks, less its refusal of a remote Hugging Face initial load:
            # unickpt.load reads safetensors from storage URLs (s3://...)
            remote_hf = bool(getattr(self, _IN_HF)) and filesystem.is_remote(
                self.initial_load_path or ""
            )
            if remote_hf:
                setattr(self, _IN_HF, False)
            try:
                BaseCheckpointManager.Config.__post_init__(self)
            finally:
                if remote_hf:
                    setattr(self, _IN_HF, True)
            if remote_hf and not self.initial_load_model_only:
                raise ValueError("initial_load_in_hf requires initial_load_model_only.")
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(
                    f"async_mode is {self.async_mode!r}; expected 'disabled', 'async' or "
                    "'async_with_pinned_mem'."
                )
            if self.initial_load_in_hf_quantized:
                raise ValueError(
                    "initial_load_in_hf_quantized is True; UnickptCheckpointManager loads "
                    "unquantized Hugging Face safetensors only. Dequantize the model first, or "
                    "use torchtitan's CheckpointManager for this load."
                )

        @classmethod
        def from_config(
            cls, config: BaseCheckpointManager.Config, **overrides: Any
        ) -> UnickptCheckpointManager.Config:
            """This manager's config with every setting of another checkpoint config kept
            (torchtitan's ``CheckpointManager.Config`` from a registry, say), then
            ``overrides`` applied. Settings this config has no field for are ignored, with a
            warning naming those that differ from their default.

            >>> config.checkpoint = UnickptCheckpointManager.Config.from_config(
            ...     config.checkpoint, enable=True, async_mode="async"
            ... )  # doctest: +SKIP
            """
            own = {f.name for f in dataclasses.fields(cls) if f.init}
            unknown = sorted(set(overrides) - own)
            if unknown:
                raise TypeError(
                    f"UnickptCheckpointManager.Config has no field {', '.join(unknown)}; "
                    f"expected some of {sorted(own)}."
                )
            values = {
                f.name: copy.deepcopy(getattr(config, f.name))
                for f in dataclasses.fields(config)
                if f.name in own
            }
            ignored = _set_fields(config, skip=own)
            if ignored:
                log.warning(
                    "UnickptCheckpointManager ignores these settings of %s: %s",
                    type(config).__qualname__,
                    ", ".join(ignored),
                )
            return cls(**{**values, **overrides})

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: SaveFuture | None = None  # type: ignore[assignment]
        if not self.enable:
            return
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        if filesystem.is_remote(self.folder):
            raise ValueError(
                f"checkpoint folder {self.folder} is remote; UnickptCheckpointManager writes to "
                "a local or mounted file system."
            )
        self.states: dict[str, Any] = dict(states)
        self.states[MODEL] = model_parts[0] if len(model_parts) == 1 else ModelParts(model_parts)
        self.states[OPTIMIZER] = StatefulView(optimizers)
        self.states[LR_SCHEDULER] = lr_schedulers
        if dataloader is not None:
            self.states[DATALOADER] = TitanLoaderState(dataloader)
        self.model_parts = model_parts
        self.sd_adapter = sd_adapter
        if (config.last_save_in_hf or config.initial_load_in_hf) and sd_adapter is None:
            raise ValueError(
                "checkpoint.last_save_in_hf or initial_load_in_hf is True, but the model has no "
                "state dict adapter (sd_adapter is None); expected the train spec's "
                "state_dict_adapter, which maps the model's keys to Hugging Face's."
            )
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._staging: SaveFuture | None = None
        self._reporter: threading.Thread | None = None  # logs the pending save's end
        self._hooks = [
            opt.register_step_pre_hook(self._before_step) for opt in _inner_optimizers(optimizers)
        ]
        self._closed = False
        self._ckpt = Checkpointer(
            self.folder,
            keep_last=config.keep_latest_k or None,
            mode=_MODES[config.async_mode],
        )
        log.info("checkpoints are saved to and loaded from %s (unickpt)", self.folder)

    def __del__(self) -> None:
        self.close()

    # -- save -----------------------------------------------------------------------------------

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step and self.config.last_save_in_hf:
            self._save_last_step_in_hf(curr_step)
            return True
        log.info("Saving the checkpoint (step %d) to %s", curr_step, self._ckpt.path(curr_step))
        begin = time.monotonic()
        if last_step:
            future = self._save_last_step(curr_step)
        else:
            future = self._ckpt.save(curr_step, self.states)
            if self.config.async_mode != "disabled":
                self.save_future = future
                self._staging = future
        self._report_when_done(future, begin)
        return True

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        c = self.config
        if c.load_only:
            return False
        return (
            last_step
            or (curr_step == 1 and c.enable_first_step_checkpoint)
            or curr_step % c.interval == 0
        )

    def _save_last_step(self, curr_step: int) -> SaveFuture:
        """The final save completes before training ends; model only unless asked for all."""
        if not self.config.last_save_model_only:
            future = self._ckpt.save(curr_step, self.states)
        else:
            future = self._ckpt.save(curr_step, {MODEL: self._exported_model()})
        self._ckpt.wait()
        return future

    def hf_path(self, step: int) -> str:
        """The folder of the Hugging Face model the last save writes with ``last_save_in_hf``
        (``step-000000100-hf``, beside the step folders: not a unickpt checkpoint, so
        neither loaded nor purged as one)."""
        return f"{self._ckpt.path(step)}-hf"

    def _save_last_step_in_hf(self, curr_step: int) -> None:
        """The final model as Hugging Face safetensors, each rank writing the bytes it holds."""
        assert self.sd_adapter is not None  # checked in __init__
        path = self.hf_path(curr_step)
        log.info("Saving the checkpoint (step %d) to %s", curr_step, path)
        begin = time.monotonic()
        hf_state = self.sd_adapter.to_hf(self._exported_model())
        report = api.save(path, hf_state, format="safetensors", overwrite=True)
        log.info(
            "Finished saving the checkpoint in %.2f seconds (%d bytes written by this rank)",
            time.monotonic() - begin,
            report.bytes_written,
        )

    def _exported_model(self) -> dict[str, Any]:
        weights = ModelParts(self.model_parts).state_dict()
        return {k: self._export(v) for k, v in weights.items()}

    def _report_when_done(self, future: SaveFuture, begin: float) -> None:
        """Log the end of a save: now if it is over, else from a thread when it is."""
        if future.done():
            _log_saved(future, begin)
            return
        self._reporter = threading.Thread(
            target=_log_saved, args=(future, begin), name="unickpt-titan-report", daemon=True
        )
        self._reporter.start()

    def _export(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.export_dtype)
        return value

    # -- load -----------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        # listed once, by the first rank, for every rank: each rank then takes the same path
        steps = decide(_comm(), "listing the checkpoints", self._ckpt.steps)
        if step != -1:
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint of step {step} in {self.folder} (committed: "
                    f"{steps or 'none'}); pass one of those, or -1 for the newest."
                )
            return self._load_path(self._ckpt.path(step), step, model_only=step == 0)
        if steps and steps[-1] > 0:
            return self._load_newest(steps[-1])
        if steps:  # a seed checkpoint holds the model only
            return self._load_path(self._ckpt.path(0), 0, model_only=True)
        path = self.config.initial_load_path
        if self.config.initial_load_in_hf:
            return self._load_hf(path or getattr(self.sd_adapter, "hf_assets_path", None))
        if not path:
            log.info("no checkpoint in %s; training starts from scratch", self.folder)
            return False
        _check_folder(path, "checkpoint.initial_load_path", "a unickpt checkpoint")
        return self._load_path(path, None, self.config.initial_load_model_only)

    def _load_hf(self, path: str | None) -> bool:
        """The model from a Hugging Face safetensors folder (or URL), through the adapter.

        ``to_hf`` names the model's own tensors (DTensor shards included) by their Hugging Face
        keys, so each rank reads only what it holds straight into them; the tensors ``to_hf``
        computes (Llama's permuted q and k projections) are copies of this rank's shards, read
        into and mapped back by ``from_hf`` before ``load_state_dict``.
        """
        if not path:
            raise CheckpointNotFoundError(
                "checkpoint.initial_load_in_hf is True but there is no folder to load: "
                "checkpoint.initial_load_path is empty and the state dict adapter has no "
                "hf_assets_path. Set initial_load_path to the Hugging Face model's folder."
            )
        _check_folder(path, "the Hugging Face model", "a safetensors model folder")
        assert self.sd_adapter is not None  # checked in __init__
        log.info("Loading the checkpoint from %s", path)
        begin = time.monotonic()
        model = self.states[MODEL]
        hf_state = self.sd_adapter.to_hf(model.state_dict())
        api.load(path, hf_state)
        model.load_state_dict(self.sd_adapter.from_hf(hf_state))
        _log_loaded(begin, None, "storage")
        return True

    def _load_path(self, path: str, step: int | None, model_only: bool) -> bool:
        log.info("Loading the checkpoint from %s", path)
        begin = time.monotonic()
        api.load(path, self._to_load(model_only))
        _log_loaded(begin, step, "storage")
        return True

    def _load_newest(self, newest: int) -> bool:
        """The newest intact step (an older one where the newest is damaged)."""
        log.info("Loading the checkpoint from %s", self._ckpt.path(newest))
        begin = time.monotonic()
        step = self._ckpt.load_latest(self._to_load(False))
        if step is None:
            return False
        restore = getattr(self._ckpt, "last_restore", None)  # set where a memory tier serves
        _log_loaded(begin, step, restore.source if restore is not None else "storage")
        return True

    def _to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return {MODEL: self.states[MODEL]}
        unknown = [k for k in self.config.exclude_from_loading if k not in self.states]
        if unknown:
            raise CheckpointError(
                f"exclude_from_loading names {unknown}, which the state does not hold; "
                f"expected some of {sorted(self.states)}."
            )
        return {k: v for k, v in self.states.items() if k not in self.config.exclude_from_loading}

    # -- waits and close ------------------------------------------------------------------------

    def _maybe_wait_for_staging(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.wait_snapshot()

    def _before_step(self, *_: Any) -> None:
        """The optimizers' step pre-hook: a zero-stall snapshot must finish before the step."""
        if self._staging is not None:
            self._maybe_wait_for_staging()

    def _wait_for_saving(self) -> None:
        self.save_future = None
        try:
            self._ckpt.wait()
        finally:
            self._join_reporter()

    def _join_reporter(self) -> None:
        reporter, self._reporter = self._reporter, None
        if reporter is not None:
            reporter.join()

    def _close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._staging = None
        self.save_future = None
        try:
            self._ckpt.close()
        finally:
            self._join_reporter()


def _check_folder(path: str, what: str, expected: str) -> None:
    """A local ``path`` must be a folder; a storage URL (``s3://...``) is left to the load.
    Looked at by the first rank for every rank (all raise, or none)."""

    def check() -> None:
        if not filesystem.is_remote(path) and not os.path.isdir(path):
            raise CheckpointNotFoundError(
                f"{what} {path} is not a folder; expected {expected} (convert others with "
                "`unickpt convert --from ...`)."
            )

    decide(_comm(), f"looking at {what}", check)


def _comm() -> Comm:
    """Every rank of the job (a world of one without torch.distributed)."""
    return Comm(None, get_config().collective_timeout_s)


def _log_saved(future: SaveFuture, begin: float) -> None:
    """``Finished saving ...`` once the save is committed (a failure is raised by the waits)."""
    future.wait_done()
    if future.exception() is not None:
        return
    seconds = time.monotonic() - begin
    written = getattr(future.wait(), "bytes_written", None)
    size = f" ({written} bytes written by this rank)" if written is not None else ""
    log.info("Finished saving the checkpoint in %.2f seconds%s", seconds, size)


def _log_loaded(begin: float, step: int | None, source: str) -> None:
    which = f"step {step}" if step is not None else "checkpoint.initial_load_path"
    log.info(
        "Finished loading the checkpoint in %.2f seconds (%s, source %s)",
        time.monotonic() - begin,
        which,
        source,
    )


def _set_fields(config: Any, skip: set[str]) -> list[str]:
    """``name=value`` of the fields of ``config`` not in ``skip`` that differ from their
    defaults."""
    out = []
    for f in dataclasses.fields(config):
        if f.name in skip or not f.init:
            continue
        value = getattr(config, f.name)
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if value != default:
            out.append(f"{f.name}={value!r}")
    return out


def _inner_optimizers(container: Any) -> list[torch.optim.Optimizer]:
    inner = getattr(container, "optimizers", None)
    if isinstance(inner, list):
        return [o for o in inner if isinstance(o, torch.optim.Optimizer)]
    return [container] if isinstance(container, torch.optim.Optimizer) else []
