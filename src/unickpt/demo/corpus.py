"""The demo's training text: generated from a tiny grammar, so nothing is downloaded.

The text is a stream of short English sentences. A character-level model learns the words
within a few dozen steps, so the loss falls visibly, and the same seed gives the same text on
every machine.

Batches are a pure function of the step: step ``s`` always draws the same global batch, and a
rank takes its slice of it. The data order therefore does not depend on the world size, and a
resumed run needs only the step to continue where it stopped.

Example::

    >>> tokens = encode(generate_text(seed=0, num_chars=10_000))
    >>> x, y = global_batch(tokens, step=1, batch_size=8, context_len=32, seed=0)
    >>> x.shape, y.shape
    (torch.Size([8, 32]), torch.Size([8, 32]))
"""

from __future__ import annotations

import random

import torch

ALPHABET = "\n .,abcdefghijklmnopqrstuvwxyz"
VOCAB_SIZE = 32  # the alphabet, padded to a size that shards evenly

_SUBJECTS = (
    "the cat",
    "a dog",
    "the old man",
    "my sister",
    "a small bird",
    "the farmer",
    "our teacher",
    "the red fox",
    "a tired horse",
    "the baker",
)
_VERBS = ("sees", "likes", "finds", "chases", "helps", "paints", "follows", "watches")
_OBJECTS = (
    "the moon",
    "a green apple",
    "the river",
    "an open door",
    "the blue boat",
    "a warm loaf",
    "the children",
    "a quiet road",
)
_PLACES = (
    "in the garden",
    "by the river",
    "at the market",
    "near the house",
    "on the hill",
    "under the tree",
    "after the rain",
    "before dinner",
)
_CHAR_TO_ID = {c: i for i, c in enumerate(ALPHABET)}


def _sentence(rng: random.Random) -> str:
    clause = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.5:
        clause += f" {rng.choice(_PLACES)}"
    if rng.random() < 0.3:
        clause += f", and {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return clause + "."


def generate_text(seed: int, num_chars: int) -> str:
    """Returns at least ``num_chars`` characters of text, the same for the same seed."""
    rng = random.Random(seed)
    lines: list[str] = []
    length = 0
    while length < num_chars:
        line = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
        lines.append(line)
        length += len(line) + 1
    return "\n".join(lines) + "\n"


def encode(text: str) -> torch.Tensor:
    """Maps text over ``ALPHABET`` to a 1-D int64 tensor of token ids."""
    unknown = set(text) - set(ALPHABET)
    if unknown:
        raise ValueError(
            f"text holds characters outside the alphabet: {sorted(unknown)!r}; "
            f"use only {ALPHABET!r}"
        )
    return torch.tensor([_CHAR_TO_ID[c] for c in text], dtype=torch.int64)


def decode(tokens: torch.Tensor) -> str:
    """Maps token ids back to text."""
    return "".join(ALPHABET[i] for i in tokens.tolist())


def global_batch(
    tokens: torch.Tensor, step: int, batch_size: int, context_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the inputs and targets of step ``step``: ``batch_size`` random windows."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - context_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(context_len)
    x = tokens[starts[:, None] + offsets]
    y = tokens[starts[:, None] + offsets + 1]
    return x, y


def rank_micro_batches(
    x: torch.Tensor, y: torch.Tensor, num_micro_batches: int, rank: int, world_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Splits a global batch into equal micro-batches and returns those of ``rank``.

    Rank ``r`` of ``world_size`` takes micro-batches ``r * k .. (r + 1) * k - 1`` where
    ``k = num_micro_batches // world_size``, so every world size sees the same micro-batches.
    """
    if num_micro_batches % world_size or x.shape[0] % num_micro_batches:
        raise ValueError(
            f"a batch of {x.shape[0]} rows cannot be split into {num_micro_batches} micro-batches "
            f"over {world_size} ranks; use a world size that divides {num_micro_batches}"
        )
    xs, ys = x.chunk(num_micro_batches), y.chunk(num_micro_batches)
    per_rank = num_micro_batches // world_size
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    return [(xs[i], ys[i]) for i in mine]
