from __future__ import annotations

from pathlib import Path

import torch

from unickpt.demo.config import DemoConfig, Phase
from unickpt.demo.corpus import encode, generate_text, global_batch, rank_micro_batches
from unickpt.demo.digest import state_digest
from unickpt.demo.events import StepDone
from unickpt.demo.model import GPTConfig
from unickpt.demo.train import build_model, build_optimizer, learning_rate, run_phase, train_step

from ..distributed import run_ranks

CONFIG = DemoConfig(
    steps=20,
    save_every=2,
    batch_size=8,
    model=GPTConfig(vocab_size=32, context_len=16, n_layers=1, n_heads=2, d_model=32),
)


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    lrs = [learning_rate(step, CONFIG) for step in range(1, CONFIG.steps + 1)]
    warmup = CONFIG.warmup_steps
    assert lrs[warmup - 1] == CONFIG.lr
    assert lrs[:warmup] == sorted(lrs[:warmup])
    assert lrs[warmup:] == sorted(lrs[warmup:], reverse=True)
    assert abs(lrs[-1] - CONFIG.lr * CONFIG.min_lr_ratio) < 1e-12


def test_weight_decay_only_on_matrices() -> None:
    optimizer = build_optimizer(build_model(CONFIG, world_size=1), CONFIG)
    decayed, plain = optimizer.param_groups
    assert all(p.dim() >= 2 for p in decayed["params"])
    assert all(p.dim() < 2 for p in plain["params"])
    assert plain["weight_decay"] == 0.0


def test_micro_batches_give_the_mean_loss_and_gradient_of_the_batch() -> None:
    tokens = encode(generate_text(CONFIG.seed, 10_000))
    x, y = global_batch(tokens, 1, CONFIG.batch_size, CONFIG.model.context_len, CONFIG.seed)
    whole = build_model(CONFIG, world_size=1)
    whole(x, y).backward()
    split = build_model(CONFIG, world_size=1)
    optimizer = torch.optim.SGD(split.parameters(), lr=0.0)
    loss = train_step(split, optimizer, rank_micro_batches(x, y, 2, 0, 1), 2, world_size=1)
    halves = [
        build_model(CONFIG, world_size=1)(xs, ys).item() for xs, ys in zip(x.chunk(2), y.chunk(2))
    ]
    assert loss == (halves[0] * 0.5) + (halves[1] * 0.5)
    for a, b in zip(whole.parameters(), split.parameters()):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_digest_follows_every_bit_of_the_state() -> None:
    model = build_model(CONFIG, world_size=1)
    optimizer = build_optimizer(model, CONFIG)
    twin = build_model(CONFIG, world_size=1)
    twin_optimizer = build_optimizer(twin, CONFIG)
    assert state_digest(model, optimizer) == state_digest(twin, twin_optimizer)
    tokens = encode(generate_text(CONFIG.seed, 10_000))
    batches = [global_batch(tokens, 1, 4, CONFIG.model.context_len, CONFIG.seed)]
    train_step(model, optimizer, batches, 1, world_size=1)
    after_step = state_digest(model, optimizer)
    assert after_step != state_digest(twin, twin_optimizer)
    exp_avg = optimizer.state[next(model.parameters())]["exp_avg"].view(-1)
    exp_avg[0] = torch.nextafter(exp_avg[0], exp_avg[0] + 1)  # one bit
    assert state_digest(model, optimizer) != after_step


def _dropout_phases(rank: int, world: int, out: str) -> dict[str, dict[int, float]]:
    """The demo's loop with dropout, on this rank: an uninterrupted run, a run saving to step 4,
    and a run of new model, optimizer and state objects resumed from its checkpoint."""
    config = DemoConfig(
        out_dir=out,
        steps=8,
        save_every=2,
        batch_size=8,
        corpus_chars=20_000,
        model=GPTConfig(
            vocab_size=32, context_len=16, n_layers=1, n_heads=2, d_model=32, dropout=0.2
        ),
    )
    phases = [
        Phase("reference", "reference", world, 8, False, False),
        Phase("train", "train", world, 4, True, False),
        Phase("resume", "resume", world, 8, True, True),
    ]
    losses: dict[str, dict[int, float]] = {p.name: {} for p in phases}

    def sink(event: object) -> None:
        if isinstance(event, StepDone):
            losses[event.phase][event.step] = event.loss

    for phase in phases:
        run_phase(config, phase, sink)
    return losses


def test_dropout_model_resumes_bit_for_bit(tmp_path: Path) -> None:
    """The state's RNGState gives a resumed run the generators of its checkpoint's step: with
    dropout, every loss after the resume equals the uninterrupted run's, bit for bit."""
    for losses in run_ranks(2, _dropout_phases, str(tmp_path / "out")):
        reference, resumed = losses["reference"], losses["resume"]
        assert sorted(resumed) == [5, 6, 7, 8]
        assert [losses["train"][s] for s in range(1, 5)] == [reference[s] for s in range(1, 5)]
        assert [resumed[s] for s in range(5, 9)] == [reference[s] for s in range(5, 9)]
