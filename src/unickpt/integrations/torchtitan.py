"""torchtitan: a checkpoint manager that saves and loads through unickpt.

The one-line switch, in a torchtitan ``Trainer.Config``::

    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    config.checkpoint = UnickptCheckpointManager.Config(enable=True, interval=500,
                                                        async_mode="async")

The trainer then builds this manager where it would build its DCP one. What it maps:

- ``model``: the model parts' state dicts merged (FSDP2/TP DTensors reshard on load);
- ``optimizer``: the optimizers container's own flat, FQN-keyed state dict;
- ``lr_scheduler``, ``train_state`` and any other state the trainer passes: their state dicts;
- ``dataloader``: each rank's own state, as a :class:`unickpt.PerRank` value (its keys,
  ``dp_rank_N``, differ between ranks);
- ``folder`` (under the dump folder) is a :class:`unickpt.Checkpointer` root, ``keep_latest_k``
  its ``keep_last`` (0: keep all), ``async_mode`` ``"disabled"`` a synchronous save, ``"async"``
  an asynchronous one (returns after the snapshot), ``"async_with_pinned_mem"`` a zero-stall one
  (``background_snapshot=True``: the snapshot overlaps the next forward and backward and
  ``maybe_wait_for_staging``, or the next optimizer step, waits for it).

Checkpoints are unickpt checkpoints (``step-000000100``): ``unickpt inspect``, ``convert``
and ``load`` read them. Loading into another world size or layout works for everything but the
data loader, whose state belongs to a data-parallel rank: list ``"dataloader"`` in
``exclude_from_loading`` when the data-parallel degree changes (as with DCP).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from .. import api
from ..checkpointer import Checkpointer
from ..engine.futures import SaveFuture
from ..errors import CheckpointError, CheckpointNotFoundError
from ..layouts.leaves import PerRank
from . import StatefulView

log = logging.getLogger(__name__)

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"


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


class PerRankState:
    """An object whose state belongs to this rank alone (a data loader's position)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {"state": PerRank(self.obj.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict["state"].value)


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
            BaseCheckpointManager.Config.__post_init__(self)
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(
                    f"async_mode is {self.async_mode!r}; expected 'disabled', 'async' or "
                    "'async_with_pinned_mem'."
                )
            if self.initial_load_in_hf or self.last_save_in_hf:
                raise ValueError(
                    "UnickptCheckpointManager reads and writes unickpt checkpoints only; for "
                    "Hugging Face safetensors use `unickpt convert --from/--to safetensors` "
                    "(initial_load_in_hf and last_save_in_hf must be False)."
                )

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
            self.states[DATALOADER] = PerRankState(dataloader)
        self.model_parts = model_parts
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._staging: SaveFuture | None = None
        self._hooks = [
            opt.register_step_pre_hook(self._before_step) for opt in _inner_optimizers(optimizers)
        ]
        self._closed = False
        self._ckpt = Checkpointer(
            self.folder,
            keep_last=config.keep_latest_k or None,
            async_save=config.async_mode != "disabled",
            background_snapshot=config.async_mode == "async_with_pinned_mem",
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
        if last_step:
            self._save_last_step(curr_step)
            return True
        future = self._ckpt.save(curr_step, self.states)
        if self.config.async_mode != "disabled":
            self.save_future = future
            self._staging = future
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

    def _save_last_step(self, curr_step: int) -> None:
        """The final save completes before training ends; model only unless asked for all."""
        if not self.config.last_save_model_only:
            self._ckpt.save(curr_step, self.states)
        else:
            weights = ModelParts(self.model_parts).state_dict()
            model = {k: self._export(v) for k, v in weights.items()}
            self._ckpt.save(curr_step, {MODEL: model})
        self._ckpt.wait()

    def _export(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.export_dtype)
        return value

    # -- load -----------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        steps = self._ckpt.steps()
        if step != -1:
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint of step {step} in {self.folder} (committed: "
                    f"{steps or 'none'}); pass one of those, or -1 for the newest."
                )
            api.load(self._ckpt.path(step), self._to_load(step == 0))
            return True
        if steps and steps[-1] > 0:
            return self._ckpt.load_latest(self._to_load(False)) is not None
        if steps:  # a seed checkpoint holds the model only
            api.load(self._ckpt.path(0), self._to_load(True))
            return True
        path = self.config.initial_load_path
        if not path:
            log.info("no checkpoint in %s; training starts from scratch", self.folder)
            return False
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(
                f"checkpoint.initial_load_path {path} is not a folder; expected a unickpt "
                "checkpoint (convert others with `unickpt convert --from ...`)."
            )
        api.load(path, self._to_load(self.config.initial_load_model_only))
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
        self._ckpt.wait()

    def _close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._staging = None
        self.save_future = None
        self._ckpt.close()


def _inner_optimizers(container: Any) -> list[torch.optim.Optimizer]:
    inner = getattr(container, "optimizers", None)
    if isinstance(inner, list):
        return [o for o in inner if isinstance(o, torch.optim.Optimizer)]
    return [container] if isinstance(container, torch.optim.Optimizer) else []
