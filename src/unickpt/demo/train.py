"""The training loop that every phase of the demo runs, on one process or under FSDP2.

Each global step uses the same global batch whatever the world size: the batch is split into
``micro_batches`` equal parts and rank ``r`` runs its share of them, accumulating gradients.
FSDP2 averages the gradients over the ranks, and on one process the loss is scaled by
``1 / micro_batches`` instead, so both compute the mean gradient of the same batch. The logged
loss is the global-batch mean, summed over the ranks.

The state saved and loaded is ``{"model", "optimizer", "train": {"step"}, "rng"}``: the step
is all a resumed run needs to draw the same next batch and learning rate, and ``rng`` (a
:class:`unickpt.RNGState`) the same dropout masks when the model has dropout.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import unickpt
from unickpt.demo.config import DemoConfig, DemoError, Phase
from unickpt.demo.corpus import encode, generate_text, global_batch, rank_micro_batches
from unickpt.demo.digest import state_digest
from unickpt.demo.events import EventSink, Loaded, PhaseFinished, PhaseStarted, StepDone
from unickpt.demo.model import GPT, count_parameters
from unickpt.demo.saves import SaveTracker


def run_phase(config: DemoConfig, phase: Phase, sink: EventSink) -> None:
    """Trains one phase on this process; call on every rank, after the process group is up."""
    started = time.perf_counter()
    # One thread per process: the kernels then reduce in one fixed order, so a step computes
    # the same bits at every world size (2 threads can pick another order on one process).
    torch.set_num_threads(1)
    model = build_model(config, phase.world_size)
    optimizer = build_optimizer(model, config)
    state: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "train": {"step": 0},
        "rng": unickpt.RNGState(),
    }
    num_parameters = count_parameters(model)
    sink(
        PhaseStarted(
            phase.name, phase.label, phase.world_size, phase.end_step, num_parameters, phase.resume
        )
    )
    if not phase.checkpoint:
        _train(config, phase, state, 1, None, sink)
    else:
        checkpointer = unickpt.Checkpointer(config.checkpoint_dir, keep_last=config.keep_last)
        start = _resume(checkpointer, state, phase, sink) if phase.resume else 0
        tracker = SaveTracker(checkpointer, phase.name, sink)
        try:
            _train(config, phase, state, start + 1, tracker, sink)
        finally:
            tracker.close()
    sink(PhaseFinished(phase.name, phase.end_step, time.perf_counter() - started))


def _train(
    config: DemoConfig,
    phase: Phase,
    state: dict[str, Any],
    first_step: int,
    tracker: SaveTracker | None,
    sink: EventSink,
) -> None:
    rank = dist.get_rank() if phase.world_size > 1 else 0
    tokens = encode(generate_text(config.seed, config.corpus_chars))
    model, optimizer = state["model"], state["optimizer"]
    for step in range(first_step, phase.end_step + 1):
        x, y = global_batch(tokens, step, config.batch_size, config.model.context_len, config.seed)
        batches = rank_micro_batches(x, y, config.micro_batches, rank, phase.world_size)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        loss = train_step(model, optimizer, batches, config.micro_batches, phase.world_size)
        save_step = step % config.save_every == 0
        digest = state_digest(model, optimizer) if save_step else None
        sink(StepDone(phase.name, step, loss, digest))
        if tracker is not None:
            tracker.poll()
            if save_step:
                state["train"]["step"] = step
                tracker.save(step, state)
            if save_step and step == phase.kill_at:
                _await_kill(phase)


# How long a rank of a phase with ``kill_at`` waits for the launcher's signal after that save.
KILL_WAIT_S = 120.0


def _await_kill(phase: Phase) -> None:
    """Wait, with the save of ``kill_at`` going on in the background, for the launcher's
    SIGKILL (the last rank) or SIGTERM (the others): the kill lands right after that save, never
    a step later, however late the launcher reads the event."""
    time.sleep(KILL_WAIT_S)  # the signal ends the process
    raise DemoError(
        f"phase {phase.name!r}: no signal came within {KILL_WAIT_S:.0f} s of the save of step "
        f"{phase.kill_at}; the launcher should have killed this rank there"
    )


def build_model(config: DemoConfig, world_size: int) -> nn.Module:
    """The same initial weights on every rank; sharded with FSDP2 when ``world_size > 1``."""
    torch.manual_seed(config.seed)
    model = GPT(config.model)
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def build_optimizer(model: nn.Module, config: DemoConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only, as in nanoGPT."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), foreach=False)


def learning_rate(step: int, config: DemoConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    micro_batches: int,
    world_size: int,
) -> float:
    """One optimizer step over this rank's micro-batches; returns the global-batch mean loss."""
    scale = world_size / micro_batches  # FSDP2 divides by world_size, so the sum is the mean
    optimizer.zero_grad(set_to_none=True)
    local_loss = torch.zeros(())
    for x, y in batches:
        loss = model(x, y) * scale
        loss.backward()
        local_loss += loss.detach() / world_size
    optimizer.step()
    if world_size > 1:
        dist.all_reduce(local_loss)
    return local_loss.item()


def _resume(
    checkpointer: unickpt.Checkpointer, state: dict[str, Any], phase: Phase, sink: EventSink
) -> int:
    started = time.perf_counter()
    step = checkpointer.load_latest(state)
    load_s = _max_over_ranks(time.perf_counter() - started, phase.world_size)
    sink(Loaded(phase.name, step, load_s, state_digest(state["model"], state["optimizer"])))
    if step is None:
        return 0
    if state["train"]["step"] != step:
        raise DemoError(
            f"the checkpoint of step {step} holds train.step={state['train']['step']}; "
            "the loaded state does not match the checkpoint's name"
        )
    return int(step)


def _max_over_ranks(value: float, world_size: int) -> float:
    if world_size == 1:
        return value
    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())
