"""Hugging Face Trainer: checkpoints saved and resumed through unickpt.

The one-line switch: ``UnickptTrainer`` in place of ``transformers.Trainer`` (same arguments),
or ``UnickptTrainerMixin`` in front of another Trainer subclass::

    from unickpt.integrations.huggingface import UnickptTrainer

    trainer = UnickptTrainer(model=model, args=TrainingArguments(save_steps=100, ...), ...)
    trainer.train()                                   # or train(resume_from_checkpoint=True)
    trainer.save_model("final")                       # save_pretrained: config + safetensors

What it maps: each ``save_steps`` checkpoint folder ``checkpoint-N`` gets a unickpt checkpoint
``checkpoint-N/unickpt`` in place of the Trainer's ``model.safetensors``, ``optimizer.pt``,
``scheduler.pt`` and ``rng_state_*.pth``, holding ``model`` (the unwrapped model),
``optimizer`` (keyed by parameter name), ``scheduler`` and ``rng`` (each rank's Python, NumPy
and torch generators, as a :class:`unickpt.PerRank` value). ``trainer_state.json`` stays the
Trainer's own, so ``save_total_limit``, ``get_last_checkpoint`` and ``resume_from_checkpoint``
work unchanged; a folder without ``unickpt`` (an ordinary Trainer checkpoint) resumes the
Trainer's way. All ranks save together (the model's replicas are written once, split between
the ranks). ``unickpt_async=True`` returns from a save after the snapshot.

``save_total_limit`` never costs the last committed checkpoint: with asynchronous saves the
Trainer's rotation is held back until the newer checkpoint is committed (checked at every step
end, at the next save and at the end of ``train``), and a save that fails leaves the older
checkpoints in place; the save of the last step is committed before the Trainer's end
(which removes checkpoints and loads the best model). ``load_best_model_at_end=True`` loads
the best checkpoint's model from its unickpt checkpoint. ``resume_from_checkpoint=True``
resumes from the newest complete checkpoint (committed, with its ``trainer_state.json``),
skipping newer incomplete ones with a warning; the first rank chooses it for every rank (ranks
choosing alone could resume from different steps). The final ``save_model`` is the Trainer's
(``save_pretrained`` on the main process); :func:`save_pretrained` (or
``UnickptTrainer(..., unickpt_save_model=True)``, which makes ``save_model(dir)`` call it)
writes the same folder from every rank of a sharded job, without gathering the model to one
rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import stat
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from .. import api
from ..config import get_config
from ..dist import Comm, decide
from ..engine.futures import SaveFuture, SaveReport
from ..errors import CheckpointError
from ..format.metadata import COMMIT_FILE
from ..layouts.leaves import PerRank

log = logging.getLogger(__name__)

SUBFOLDER = "unickpt"
PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR
TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
TRAINING_ARGS = "training_args.bin"  # transformers' TRAINING_ARGS_NAME
_STEP = re.compile(rf"^{PREFIX}-(\d+)$")


class UnickptTrainerMixin:
    """Put in front of a ``transformers.Trainer`` (subclass) to checkpoint through unickpt."""

    def __init__(
        self,
        *args: Any,
        unickpt_async: bool = False,
        unickpt_save_model: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.unickpt_async = unickpt_async
        self.unickpt_save_model = unickpt_save_model  # save_model(dir): save_pretrained below
        self._unickpt_pending: SaveFuture | None = None
        self._unickpt_rotation: str | None = None  # the run folder to rotate once committed
        self._unickpt_folder: str | None = None
        trainer: Any = self
        trainer.add_callback(_RotateWhenCommitted(self))

    # -- train: resume from the newest complete checkpoint, end with the last one committed ----

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        trainer: Any = self
        if resume_from_checkpoint is True:
            resume_from_checkpoint = _agreed_checkpoint(trainer.args.output_dir) or True
        output = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        self.wait_for_checkpoint()
        trainer.accelerator.wait_for_everyone()  # every rank returns with the rotation done
        return output

    # -- save: the unickpt checkpoint first, then the Trainer's light files ----------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer: Any = self
        run_dir = trainer._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX}-{trainer.state.global_step}")
        self.wait_for_checkpoint()
        state = self._unickpt_state(with_training=not trainer.args.save_only_model)
        target = os.path.join(folder, SUBFOLDER)
        if not self.unickpt_async:
            api.save(target, state, overwrite=True)
            self._save_trainer_files(model, trial, folder)  # and rotates, the Trainer's way
            return
        self._unickpt_pending = api.async_save(target, state, overwrite=True)
        with _rotation_held(trainer.args):  # nothing older goes before this one is committed
            self._save_trainer_files(model, trial, folder)
        self._unickpt_rotation = run_dir
        if (
            trainer.control.should_training_stop
            or trainer.state.global_step >= trainer.state.max_steps
        ):
            # Training ends after this step, and the Trainer's end removes checkpoints
            # (save_total_limit=1 with a best model) and loads the best one: this save first.
            # Nothing is lost: train() waited for it anyway.
            self.wait_for_checkpoint()
        else:
            self.rotate_if_committed()

    def _save_trainer_files(self, model: Any, trial: Any, folder: str) -> None:
        """The Trainer's own ``_save_checkpoint``: ``trainer_state.json`` and the rotation."""
        self._unickpt_folder = folder
        try:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
        finally:
            self._unickpt_folder = None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if _internal_call and self._in_checkpoint_save(output_dir):
            return  # the weights are in the unickpt checkpoint
        if self.unickpt_save_model and not _internal_call:
            trainer: Any = self
            save_pretrained(trainer, output_dir or trainer.args.output_dir)
            return
        super().save_model(output_dir, _internal_call)  # type: ignore[misc]

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._in_checkpoint_save(output_dir):
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]

    def _save_rng_state(self, output_dir: str) -> None:
        if not self._in_checkpoint_save(output_dir):
            super()._save_rng_state(output_dir)  # type: ignore[misc]

    def wait_for_checkpoint(self) -> None:
        """Wait for the pending asynchronous save; re-raise its failure (the older checkpoints
        then stay); once it is committed, apply ``save_total_limit``."""
        pending, self._unickpt_pending = self._unickpt_pending, None
        run_dir, self._unickpt_rotation = self._unickpt_rotation, None
        if pending is None:
            return
        pending.wait()
        if run_dir is not None:
            self._rotate(run_dir)

    def rotate_if_committed(self) -> None:
        """Apply ``save_total_limit`` if the pending save is committed; never waits or raises
        for it (a failure is raised where every rank waits: the next save, the end of train)."""
        pending = self._unickpt_pending
        if pending is not None and pending.done() and pending.exception() is None:
            self.wait_for_checkpoint()

    def _rotate(self, run_dir: str) -> None:
        trainer: Any = self
        if not trainer.args.should_save:
            return
        legacy = getattr(super(), "_rotate_checkpoints", None)  # transformers 4
        if legacy is not None:
            legacy(use_mtime=False, output_dir=run_dir)
            return
        from transformers.trainer_utils import rotate_checkpoints

        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=trainer.args.save_total_limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            use_mtime=True,  # as the Trainer's own call
        )

    # -- resume ---------------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        path = _unickpt_path(resume_from_checkpoint)
        if path is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        self.wait_for_checkpoint()
        api.load(path, {"model": _unwrap(model if model is not None else self.model)})  # type: ignore[attr-defined]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        path = _unickpt_path(checkpoint)
        if path is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        trainer: Any = self
        api.load(
            path,
            {
                "model": _unwrap(trainer.model),  # names the optimizer's parameters
                "optimizer": _inner(trainer.optimizer),
                "scheduler": trainer.lr_scheduler,
            },
        )

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's model, from its unickpt checkpoint."""
        trainer: Any = self
        best = trainer.state.best_model_checkpoint
        path = _unickpt_path(best)
        if path is None:
            super()._load_best_model()  # type: ignore[misc]
            return
        self.wait_for_checkpoint()
        log.info("loading the best model from %s (score: %s)", best, trainer.state.best_metric)
        api.load(path, {"model": _unwrap(trainer.model)})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        path = _unickpt_path(checkpoint)
        if path is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        holder = PerRank(None)
        api.load(path, {"rng": holder})
        _set_rng(holder.value)

    def _unickpt_state(self, with_training: bool) -> dict[str, Any]:
        trainer: Any = self
        state: dict[str, Any] = {"model": _unwrap(trainer.model)}
        if with_training:
            state["optimizer"] = _inner(trainer.optimizer)
            if trainer.lr_scheduler is not None:
                state["scheduler"] = trainer.lr_scheduler
            state["rng"] = PerRank(_rng_state())
        return state

    def _in_checkpoint_save(self, output_dir: str | None) -> bool:
        """Whether the Trainer is writing a ``checkpoint-N`` folder that unickpt already holds."""
        return output_dir is not None and output_dir == self._unickpt_folder


class UnickptTrainer(UnickptTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints are unickpt checkpoints."""


class _RotateWhenCommitted(TrainerCallback):
    """At every step end: rotate as soon as the pending asynchronous save is committed."""

    def __init__(self, trainer: UnickptTrainerMixin) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.trainer.rotate_if_committed()
        return control


@contextlib.contextmanager
def _rotation_held(args: Any) -> Iterator[None]:
    """The Trainer's ``_save_checkpoint`` rotates when ``save_total_limit`` is set: unset it."""
    limit = args.save_total_limit
    args.save_total_limit = None
    try:
        yield
    finally:
        args.save_total_limit = limit


def save_pretrained(trainer: Any, path: str, *, max_shard_size: int | str = "5GB") -> SaveReport:
    """Write the trainer's model as ``trainer.save_model(path)`` does, from every rank.

    Every rank calls it together. The weights go through
    ``unickpt.save(path, state, format="safetensors")``: each rank writes the bytes it holds
    (a DDP replica's share, an FSDP2 shard) straight into ``model.safetensors`` (or shards of
    about ``max_shard_size`` and ``model.safetensors.index.json``), with no gather to one rank.
    Tied weights are written once, as ``save_pretrained`` does. The process that saves
    (``args.should_save``) then writes the config (and generation config), the processing
    class (tokenizer) and ``training_args.bin``, and every rank returns once all is written,
    with its save's report (``bytes_written`` by this rank).

    >>> trainer.train()  # doctest: +SKIP
    >>> save_pretrained(trainer, "out/final")  # doctest: +SKIP
    >>> GPT2LMHeadModel.from_pretrained("out/final")  # doctest: +SKIP
    """
    model = _unwrap(trainer.model)
    report = api.save(
        path,
        dict(model.state_dict()),
        format="safetensors",
        max_shard_size=max_shard_size,
        overwrite=True,
    )
    if trainer.args.should_save:
        _save_model_files(trainer, model, path)
    trainer.accelerator.wait_for_everyone()
    log.info("saved the model to %s (%d bytes written by this rank)", path, report.bytes_written)
    return report


def _save_model_files(trainer: Any, model: Any, path: str) -> None:
    """What ``Trainer.save_model`` writes beside the weights."""
    model.config.save_pretrained(path)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(path)
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(path)
    torch.save(trainer.args, os.path.join(path, TRAINING_ARGS))


def last_complete_checkpoint(run_dir: str) -> str | None:
    """The newest ``checkpoint-N`` in ``run_dir`` that a resume can use: its
    ``trainer_state.json`` written and its unickpt checkpoint committed (or, for an ordinary
    Trainer checkpoint, none). Newer incomplete ones (a save that failed or was cut off) are
    skipped with a warning; None if there is no complete one."""
    return _warn_skipped(*_newest_complete(run_dir))


def _agreed_checkpoint(run_dir: str) -> str | None:
    """:func:`last_complete_checkpoint`, decided once for every rank: the first rank lists and
    checks the folders, every rank gets its choice (or its error) and logs what was skipped.
    Ranks choosing alone could resume from different steps (a folder one rank saw committed
    and another not yet)."""
    what = f"choosing the checkpoint to resume from in {run_dir}"
    return _warn_skipped(*decide(_comm(), what, lambda: _newest_complete(run_dir)))


def _warn_skipped(folder: str | None, skipped: list[str]) -> str | None:
    for message in skipped:
        log.warning(message)
    return folder


def _newest_complete(run_dir: str) -> tuple[str | None, list[str]]:
    """The newest complete ``checkpoint-N`` folder, and why each newer one was skipped."""
    skipped: list[str] = []
    for folder in _checkpoint_folders(run_dir):
        missing = _missing(folder)
        if missing is None:
            return folder, skipped
        skipped.append(f"not resuming from {folder}: {missing}; trying an older checkpoint")
    return None, skipped


def _checkpoint_folders(run_dir: str) -> list[str]:
    """``checkpoint-N`` folders, newest step first."""
    if not _is(run_dir, stat.S_ISDIR):
        return []
    steps = [(int(m.group(1)), name) for name in os.listdir(run_dir) if (m := _STEP.match(name))]
    folders = [os.path.join(run_dir, name) for _, name in sorted(steps, reverse=True)]
    return [f for f in folders if _is(f, stat.S_ISDIR)]


def _missing(folder: str) -> str | None:
    """What keeps ``folder`` from being a complete checkpoint, or None."""
    if not _is(os.path.join(folder, TRAINER_STATE), stat.S_ISREG):
        return f"it has no {TRAINER_STATE}"
    path = os.path.join(folder, SUBFOLDER)
    if _is(path, stat.S_ISDIR) and not _is(os.path.join(path, COMMIT_FILE), stat.S_ISREG):
        return f"its unickpt checkpoint was never committed (no {SUBFOLDER}/{COMMIT_FILE})"
    return None


def _is(path: str, kind: Callable[[int], bool]) -> bool:
    """Whether ``path`` is there as ``kind`` (``stat.S_ISDIR``, ``stat.S_ISREG``). Absent is
    False; a check that fails otherwise raises: it is no evidence that the file is missing, and
    taking it for one would resume from an older checkpoint."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise CheckpointError(
            f"checking {path} failed ({e.strerror or e}); a failed check is not taken for a "
            "missing file. Fix the file system and resume again, or name the checkpoint to "
            "resume from (resume_from_checkpoint='.../checkpoint-N')."
        ) from e
    return kind(mode)


def _unickpt_path(checkpoint: str | None) -> str | None:
    """``checkpoint/unickpt`` if the Trainer's checkpoint folder holds a unickpt checkpoint,
    else None (the Trainer loads it its own way). Decided by the first rank for every rank
    (the Trainer calls its loaders on all of them): a rank answering alone could skip the
    collective load the others wait in."""
    if checkpoint is None:
        return None
    path = os.path.join(checkpoint, SUBFOLDER)
    what = f"looking for a unickpt checkpoint in {checkpoint}"
    return path if decide(_comm(), what, lambda: _is(path, stat.S_ISDIR)) else None


def _comm() -> Comm:
    """Every rank of the job (a world of one without torch.distributed)."""
    return Comm(None, get_config().collective_timeout_s)


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _inner(optimizer: Any) -> Any:
    """accelerate's optimizer wrapper holds the torch optimizer as ``.optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(np.array(keys)), pos, has_gauss, gauss],
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
