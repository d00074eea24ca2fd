"""A torchtitan config registry for ``python -m torchtitan.train --module`` (tests).

``--module tests.integrations.titan_entry_config --config llama3_debugmodel_unickpt``:
torchtitan's own llama3 debug model config, its checkpoint section switched to unickpt's
manager as the documentation says, and attention through torchtitan's SDPA module (flex
attention has no CPU backward).
"""

from __future__ import annotations

from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from unickpt.integrations.torchtitan import UnickptCheckpointManager


def llama3_debugmodel_unickpt() -> Trainer.Config:
    config = llama3_debugmodel()
    config.checkpoint = UnickptCheckpointManager.Config.from_config(config.checkpoint, enable=True)
    assert config.model_spec is not None
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config
