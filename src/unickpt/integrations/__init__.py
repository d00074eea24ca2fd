"""Drop-in checkpointing for training frameworks, one module per framework.

Each module imports its framework, which is an optional extra of unickpt:

- :mod:`unickpt.integrations.torchtitan` (``pip install unickpt[torchtitan]``):
  ``UnickptCheckpointManager``, a torchtitan checkpoint manager.
- :mod:`unickpt.integrations.lightning` (``unickpt[lightning]``): ``UnickptCheckpointIO``, a
  Lightning ``CheckpointIO`` plugin, and ``UnickptModelParallelStrategy`` (FSDP2, TP).
- :mod:`unickpt.integrations.huggingface` (``unickpt[huggingface]``): ``UnickptTrainer`` (and
  ``UnickptTrainerMixin``), the Hugging Face ``Trainer`` with unickpt checkpoints.

They use only the public API (``unickpt.save``, ``load``, ``async_save``, ``Checkpointer``).
"""

from __future__ import annotations

from typing import Any


class StatefulView:
    """An object's own ``state_dict``/``load_state_dict``, and nothing else.

    Frameworks' optimizer containers subclass ``torch.optim.Optimizer`` but give a state dict
    of their own format; behind this view unickpt stores that dict as it is, like any other
    stateful object's.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return dict(self.obj.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)
