from __future__ import annotations

import math

import pytest
import torch

from unickpt.demo.corpus import encode, generate_text, global_batch
from unickpt.demo.model import GPT, GPTConfig, count_parameters

TINY = GPTConfig(vocab_size=32, context_len=16, n_layers=1, n_heads=2, d_model=32)


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def test_initial_loss_is_about_uniform() -> None:
    idx = torch.randint(0, TINY.vocab_size, (4, TINY.context_len))
    loss = _model()(idx, idx)
    assert loss.shape == ()
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.2


def test_same_seed_same_weights() -> None:
    a, b = _model(1).state_dict(), _model(1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert count_parameters(_model()) == sum(v.numel() for v in a.values())


def test_heads_must_divide_the_width() -> None:
    with pytest.raises(ValueError, match="multiple of n_heads"):
        GPTConfig(d_model=30, n_heads=4)


def test_attention_is_causal() -> None:
    model = _model()
    idx = torch.randint(0, TINY.vocab_size, (1, TINY.context_len))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % TINY.vocab_size
    # Targets only at the first position: its loss must not see the last token.
    targets = torch.full_like(idx, -100)
    targets[0, 0] = 3
    assert model(idx, targets).item() == model(changed, targets).item()


def test_loss_falls_on_the_corpus() -> None:
    model = _model()
    tokens = encode(generate_text(seed=0, num_chars=20_000))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(1, 31):
        x, y = global_batch(tokens, step, 8, TINY.context_len, seed=0)
        loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
