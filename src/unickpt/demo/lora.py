"""LoRA adapters for the demo GPT: a frozen base, low-rank updates trained (fine-tune jobs).

>>> import torch
>>> from unickpt.demo.model import GPT, GPTConfig
>>> model = add_lora(GPT(GPTConfig(n_layers=1, d_model=32, n_heads=2)), rank=4)
>>> sum(p.numel() for p in model.parameters() if p.requires_grad)
1152
"""

from __future__ import annotations

import torch
from torch import nn

from .model import GPT, Block


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trained low-rank update ``lora_b @ lora_a`` (zero at first)."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T


def add_lora(model: GPT, rank: int) -> GPT:
    """Freeze ``model`` and put adapters on every attention input and MLP input layer."""
    model.requires_grad_(False)
    for block in model.blocks:
        assert isinstance(block, Block)
        setattr(block.attn, "qkv", LoRALinear(block.attn.qkv, rank))  # noqa: B010 - typed Linear
        setattr(block.mlp, "fc", LoRALinear(block.mlp.fc, rank))  # noqa: B010
    return model
