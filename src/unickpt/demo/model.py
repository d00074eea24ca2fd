"""A small GPT in the style of nanoGPT: causal self-attention, an MLP, pre-LayerNorm.

The demo runs it without dropout, so a step is a pure function of the weights, the optimizer
state and the batch, on any world size. With ``dropout > 0`` a step also draws from the ranks'
generators: the training state then holds a :class:`unickpt.RNGState`, and a run resumed on the
world size that saved it draws the masks the uninterrupted run drew.

Example::

    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = GPT(GPTConfig(n_layers=1, d_model=32, n_heads=2, context_len=16))
    >>> idx = torch.zeros(2, 16, dtype=torch.int64)
    >>> model(idx, idx).shape
    torch.Size([])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape."""

    vocab_size: int = 32
    context_len: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 256
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}; "
                "choose sizes where it is"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        heads = (batch, time, self.n_heads, channels // self.n_heads)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout) if config.dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks, a final norm and the output head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.context_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Returns the mean cross-entropy of predicting ``targets`` from ``idx``."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def count_parameters(model: nn.Module) -> int:
    """The number of parameters (of the whole model, also when it is sharded)."""
    return sum(p.numel() for p in model.parameters())
