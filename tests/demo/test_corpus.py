from __future__ import annotations

import pytest
import torch

from unickpt.demo.corpus import (
    ALPHABET,
    VOCAB_SIZE,
    decode,
    encode,
    generate_text,
    global_batch,
    rank_micro_batches,
)


def test_text_is_deterministic_and_within_the_alphabet() -> None:
    text = generate_text(seed=3, num_chars=5_000)
    assert text == generate_text(seed=3, num_chars=5_000)
    assert text != generate_text(seed=4, num_chars=5_000)
    assert len(text) >= 5_000
    assert set(text) <= set(ALPHABET)
    assert len(ALPHABET) <= VOCAB_SIZE


def test_encode_decode_round_trip() -> None:
    text = generate_text(seed=0, num_chars=500)
    assert decode(encode(text)) == text


def test_encode_names_unknown_characters() -> None:
    with pytest.raises(ValueError, match="'!'"):
        encode("hello!")


def test_global_batch_depends_only_on_the_step() -> None:
    tokens = encode(generate_text(seed=0, num_chars=4_000))
    x, y = global_batch(tokens, step=5, batch_size=6, context_len=16, seed=0)
    x2, y2 = global_batch(tokens, step=5, batch_size=6, context_len=16, seed=0)
    x3, _ = global_batch(tokens, step=6, batch_size=6, context_len=16, seed=0)
    assert x.shape == y.shape == (6, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, x3)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next characters


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_together_cover_the_global_batch_in_order(world_size: int) -> None:
    x = torch.arange(8 * 3).view(8, 3)
    parts = [
        part
        for rank in range(world_size)
        for part in rank_micro_batches(x, x + 100, 4, rank, world_size)
    ]
    assert len(parts) == 4
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), x + 100)


def test_micro_batches_must_divide_over_the_ranks() -> None:
    x = torch.zeros(8, 3)
    with pytest.raises(ValueError, match="world size that divides 2"):
        rank_micro_batches(x, x, 2, 0, 3)
