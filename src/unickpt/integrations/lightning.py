"""Lightning: a ``CheckpointIO`` plugin that saves and loads through unickpt.

The one-line switch::

    from unickpt.integrations.lightning import UnickptCheckpointIO

    trainer = L.Trainer(
        plugins=[UnickptCheckpointIO()],                    # or (async_save=True)
        callbacks=[ModelCheckpoint(dirpath="checkpoints", save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")  # the first run starts fresh, later ones resume

What it maps: every checkpoint Lightning writes (``ModelCheckpoint``'s ``*.ckpt``, ``last.ckpt``,
``trainer.save_checkpoint``) becomes a unickpt checkpoint folder at that path, holding Lightning's
whole checkpoint dict (model ``state_dict``, ``optimizer_states``, ``lr_schedulers``, loops,
callbacks, hyperparameters; see :mod:`unickpt.integrations.nested`). ``remove_checkpoint``
deletes the folder. A ``torch.save`` file (a checkpoint of a run before the switch) is loaded
with Lightning's own reader and a warning; anything else is refused as "not a unickpt
checkpoint". With ``async_save=True`` the save returns after the snapshot and is written,
checksummed and committed in the background; the next save, a removal, a load and the end of
training wait for it.

Lightning calls ``save_checkpoint`` on global rank 0 alone (DDP state is replicated), so the
save runs over a process group of that rank only; ``load_checkpoint`` runs on every rank, each
reading the whole checkpoint, as ``torch.load`` would.

Sharded training (FSDP2, tensor parallel) goes through :class:`UnickptModelParallelStrategy`,
Lightning's ``ModelParallelStrategy`` with its distributed checkpoints written by unickpt: every
rank saves its shards of the model and the optimizers together (nothing gathered), and a load
reshards them into the current layout::

    trainer = L.Trainer(strategy=UnickptModelParallelStrategy(data_parallel_size=2), ...)
"""

from __future__ import annotations

import logging
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from .. import api
from ..engine.futures import SaveFuture
from ..errors import CheckpointError, CheckpointNotFoundError
from .nested import every_rank, from_state, load_nested, save_nested, template, to_state

log = logging.getLogger(__name__)


class UnickptCheckpointIO(CheckpointIO):
    """Lightning checkpoints as unickpt checkpoints.

    ``async_save``: return after the snapshot (writes go on in the background).
    ``allow_pickle``: store objects that only pickle can (hyperparameters such as a
    ``Namespace``); without it such a checkpoint is refused with the name of the entry.
    """

    def __init__(self, *, async_save: bool = False, allow_pickle: bool = False) -> None:
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self._pending: SaveFuture | None = None
        self._group: Any = None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "UnickptCheckpointIO.save_checkpoint takes no storage_options; unickpt writes "
                "to a local or mounted file system."
            )
        self.wait()
        target = Path(path)
        if target.is_file():  # a torch.save checkpoint left at this name by an earlier run
            target.unlink()
        self._pending = save_nested(
            target,
            checkpoint,
            group=self._own_group(),
            allow_pickle=self.allow_pickle,
            asynchronous=self.async_save,
        )

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a unickpt checkpoint folder; a ``torch.save`` file (a checkpoint written
        before the switch) is read by Lightning's own ``TorchCheckpointIO``, with a warning."""
        self.wait()
        target = Path(path)
        if target.is_file():
            return _load_torch_file(target, map_location, weights_only)
        if not target.exists():
            raise CheckpointNotFoundError(
                f"Checkpoint not found: nothing is at {target}; expected a unickpt checkpoint "
                "folder (or a torch.save file). Check the path, or resume with "
                'ckpt_path="last" (which starts from scratch when there is no checkpoint yet).'
            )
        allow = self.allow_pickle and weights_only is not True
        loaded = load_nested(target, group=self._own_group(), allow_pickle=allow)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{target} holds a {type(loaded).__name__}, not a dict.")
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        self.wait()
        target = Path(path)
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()

    def wait(self) -> None:
        """Wait for the pending asynchronous save; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def teardown(self) -> None:
        self.wait()

    def _own_group(self) -> Any:
        """A process group of this rank alone: Lightning calls the plugin on one rank at a
        time, and a collective over the world would wait for ranks that never come."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        if self._group is None:
            rank = dist.get_rank()
            self._group = dist.new_group([rank], use_local_synchronization=True)
        return self._group


class UnickptModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 and tensor parallel) whose checkpoints are unickpt's.

    Takes the arguments of ``ModelParallelStrategy``. A checkpoint is a unickpt folder holding
    ``state_dict`` (the sharded model), ``optimizer_0``... (keyed by parameter name) and the rest
    of Lightning's checkpoint dict (loops, callbacks, schedulers) as in
    :class:`UnickptCheckpointIO`. ``async_save=True`` returns after the snapshot.
    """

    def __init__(self, *args: Any, async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.async_save = async_save
        self._pending: SaveFuture | None = None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the save takes the model's own (sharded) tensors, nothing is copied

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "UnickptModelParallelStrategy.save_checkpoint takes no storage_options."
            )
        self.wait()
        path = Path(self.broadcast(filepath))
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        prepared = every_rank(None, "preparing the save", lambda: to_state(rest, False))
        state = {**self._live_state(), **prepared}
        if self.async_save:
            self._pending = api.async_save(path, state, overwrite=True)
        else:
            api.save(path, state, overwrite=True)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.wait()
        path = Path(self.broadcast(checkpoint_path))
        held = every_rank(None, "reading what the checkpoint holds", lambda: template(path))
        state = {**self._live_state(), **held}
        api.load(path, state)
        loaded = from_state(state, allow_pickle=False)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a dict.")
        return loaded

    def wait(self) -> None:
        """Wait for the pending asynchronous save; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def remove_checkpoint(self, filepath: Any) -> None:
        self.wait()
        if self.is_global_zero:
            shutil.rmtree(Path(filepath), ignore_errors=True)

    def teardown(self) -> None:
        self.wait()
        super().teardown()

    def _live_state(self) -> dict[str, Any]:
        optimizers = {f"optimizer_{i}": _inner(o) for i, o in enumerate(self.optimizers)}
        return {"state_dict": self.model, **optimizers}


def _load_torch_file(path: Path, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
    """A ``torch.save`` checkpoint, read the way Lightning reads it without the plugin."""
    if not _is_torch_file(path):
        raise CheckpointNotFoundError(
            f"{path} is not a unickpt checkpoint: it is a file, and not one torch.save wrote "
            "either (no zip archive or pickle header); expected a unickpt checkpoint folder "
            "written by UnickptCheckpointIO, or a torch.save file. Check the path."
        )
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    log.warning(
        "%s is a torch.save checkpoint, not a unickpt checkpoint folder: loading it with "
        "Lightning's TorchCheckpointIO; the next save at this name is a unickpt checkpoint",
        path,
    )
    kwargs = {} if map_location is None else {"map_location": map_location}
    loaded = TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only, **kwargs)
    return dict(loaded)


def _is_torch_file(path: Path) -> bool:
    """torch.save writes a zip archive, or (legacy format) a pickle: protocol 2 or later."""
    if zipfile.is_zipfile(path):
        return True
    with path.open("rb") as f:
        return f.read(1) == b"\x80"


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps the optimizer
