"""A GPT-style transformer of a chosen size, sharded with FSDP2, with AdamW state initialized.

Two layouts are built: ``"shard0"`` (FSDP2's default ``Shard(0)``) is the layout every system
saves from; ``"shard1"`` places every matrix as ``Shard(1)`` and is the target of the resharded
load, so each rank needs a piece of every saved shard. The model is built on the meta device,
sharded, then each rank fills only its own shards (random values, seeded per rank and tensor),
and AdamW's moments come from one step on gradients derived from the parameters: building costs
no forward pass and no full-size initialization, so a benchmark run can start many jobs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

Layout = Literal["shard0", "shard1"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model; every width is a multiple of 64 so it splits evenly over ranks."""

    vocab: int
    d_model: int
    n_layer: int
    n_head: int
    max_seq: int

    @property
    def param_count(self) -> int:
        d = self.d_model
        per_block = 12 * d * d + 13 * d
        return 2 * self.vocab * d + self.max_seq * d + self.n_layer * per_block + 2 * d


def config_for_params(target: int, *, vocab: int = 16384, max_seq: int = 256) -> GPTConfig:
    """Pick depth and width (``d_model = 64 * n_layer``, as in GPT-2) closest to ``target``."""
    vocab = min(vocab, max(512, _round_to(target // 2000, 64)))
    best: GPTConfig | None = None
    for n_layer in range(1, 64):
        d = 64 * n_layer
        candidate = GPTConfig(vocab, d, n_layer, max(1, d // 64), max_seq)
        if best is None or _distance(candidate, target) < _distance(best, target):
            best = candidate
    assert best is not None
    return best


def _round_to(value: int, multiple: int) -> int:
    return max(multiple, (value // multiple) * multiple)


def _distance(config: GPTConfig, target: int) -> float:
    return abs(math.log(config.param_count / target))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        heads = [z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v)]
        q, k, v = heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.d_model)
        self.pos = nn.Embedding(config.max_seq, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


@dataclass
class TrainState:
    """A sharded model, its optimizer, and one training iteration split where a checkpoint
    would sit: ``forward_backward`` then ``step``.

    The runner, the digest check and the perturbation before each load use only ``model``
    (its named parameters), ``optimizer`` (its state per parameter) and these methods. Another
    workload builds its own sharded model into a subclass that overrides ``forward_backward``
    (its batch and loss); the default trains the GPT of this module on a fixed batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    layout: Layout
    seq_len: int
    device: str = "cpu"

    def forward_backward(self) -> None:
        model = self.model
        if not isinstance(model, GPT):
            raise TypeError(
                f"{type(self).__name__} holds a {type(model).__name__}, not the GPT; a workload "
                "with another model overrides TrainState.forward_backward"
            )
        vocab = model.config.vocab
        gen = torch.Generator().manual_seed(1234)
        shape = (1, self.seq_len)
        idx = torch.randint(0, vocab, shape, generator=gen)
        targets = torch.randint(0, vocab, shape, generator=gen)
        model(idx.to(self.device), targets.to(self.device)).backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on CPU), before reading a clock."""
        if self.device != "cpu":
            torch.cuda.synchronize()

    def state(self) -> dict[str, object]:
        return {"model": self.model, "optimizer": self.optimizer}


def _placement_fn(layout: Layout) -> Callable[[nn.Parameter], object] | None:
    if layout == "shard0":
        return None
    from torch.distributed.tensor import Shard

    return lambda param: Shard(1) if param.dim() >= 2 else Shard(0)


def build_train_state(
    config: GPTConfig, layout: Layout, seq_len: int, device: str = "cpu"
) -> TrainState:
    """Build the sharded model on ``device`` (``"cpu"`` or ``"cuda"``, the current CUDA device)
    and run one optimizer step so AdamW's ``exp_avg``/``exp_avg_sq``/``step`` exist. Needs an
    initialized process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = GPT(config)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    placement = _placement_fn(layout)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, shard_placement_fn=placement)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)  # type: ignore[arg-type]
    target = torch.device(device, torch.cuda.current_device()) if device == "cuda" else device
    model.to_empty(device=target)
    _fill_local_shards(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    with torch.no_grad():
        for param in model.parameters():
            param.grad = param.detach() * 0.5 + 0.01
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = TrainState(model, optimizer, layout, seq_len, device)
    state.synchronize()
    log.debug("built %s model: %d parameters", layout, config.param_count)
    return state


def _fill_local_shards(model: GPT) -> None:
    """Random values in this rank's shards only, a different stream per rank and tensor."""
    rank = dist.get_rank()
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            local = local_part(param)
            gen = torch.Generator().manual_seed(1_000_003 * rank + index)
            values = torch.randn(local.shape, generator=gen, dtype=local.dtype).mul_(0.02)
            local.copy_(values)


def local_state_bytes(state: TrainState) -> int:
    """Bytes of this rank's shards of parameters and optimizer tensors."""
    total = 0
    for param in state.model.parameters():
        total += local_part(param).nbytes
        for value in state.optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor):
                total += local_part(value).nbytes
    return total


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (its local shard when it is a DTensor)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
