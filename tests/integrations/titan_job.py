"""A small torchtitan training job on CPU, run in spawned gloo processes.

torchtitan's own debug model, its parallelize function (FSDP2, TP), optimizers container, LR
schedulers, data loader and the trainer's train state; the data set is a seeded token stream.
Two settings make torchtitan run on CPU with gloo: its device type is set to ``cpu`` (it
assumes an accelerator) and attention uses its SDPA module (flex attention has no CPU backward).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

import torchtitan.distributed.parallel_dims as _parallel_dims  # isort: skip
import torchtitan.tools.utils as _titan_utils  # isort: skip

_titan_utils.device_type = "cpu"
_parallel_dims.device_type = "cpu"

from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed.activation_checkpoint import SelectiveAC  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from unickpt.integrations.torchtitan import UnickptCheckpointManager  # noqa: E402

SEQ = 32
BATCH = 2
VOCAB = 2048


class TokenStream(IterableDataset, Stateful):
    """Seeded random tokens, a different stream per data-parallel rank; resumable."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.pos = 0

    def __iter__(self) -> Any:
        while True:
            g = torch.Generator().manual_seed(100_000 * self.dp_rank + self.pos)
            self.pos += 1
            x = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield x[:-1], x[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pos = state_dict["pos"]


class TrainState(Stateful):
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class Records(logging.Handler):
    """The manager's log messages, as torchtitan's logger (root, INFO) would print them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def record_logs() -> Records:
    init_logger()  # what torchtitan's train.py does: the root logger at INFO, to stdout
    records = Records()
    logging.getLogger("unickpt.integrations.torchtitan").addHandler(records)
    return records


@dataclass
class Job:
    model: torch.nn.Module
    optimizers: Any
    schedulers: Any
    dataloader: ParallelAwareDataloader
    train_state: TrainState
    manager: UnickptCheckpointManager
    iterator: Any = None


def build(world: int, tp: int, folder: str, steps: int, **checkpoint: Any) -> Job:
    torch.manual_seed(0)
    spec = model_registry("debugmodel")
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor", data_parallel_shard_degree=-1, tensor_parallel_degree=tp
    )
    dims = ParallelDims.from_config(parallelism, world)
    training = TrainingConfig(
        mixed_precision_param="float32", seq_len=SEQ, local_batch_size=BATCH, steps=steps
    )
    spec.model.update_from_config(
        config=Trainer.Config(model_spec=spec, parallelism=parallelism, training=training)
    )
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=SelectiveAC.Config(),
        dump_folder=folder,
    )
    for m in model.modules():  # gloo has no PREMUL_SUM: reduce gradients with a plain sum
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optimizer_config = default_adamw(lr=8e-4)
    optimizer_config.implementation = "for-loop"
    optimizers = optimizer_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=steps
    )
    dp_rank = dist.get_rank() // tp
    loader = ParallelAwareDataloader(
        TokenStream(dp_rank), dp_rank=dp_rank, dp_world_size=world // tp, batch_size=BATCH
    )
    train_state = TrainState()
    config = UnickptCheckpointManager.Config(enable=True, folder="ckpt", **checkpoint)
    manager = config.build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=adapter(),
        base_folder=folder,
    )
    return Job(model, optimizers, schedulers, loader, train_state, manager)


def adapter() -> Any:
    """The debug model's state dict adapter (Hugging Face names), as the trainer builds it."""
    spec = model_registry("debugmodel")
    return spec.state_dict_adapter(spec.model, None)


def write_hf_model(path: str, seed: int) -> None:
    """A Hugging Face safetensors model of the debug model (weights from ``seed``), written
    with safetensors itself: the unsharded model's state through the adapter's ``to_hf``."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    spec = model_registry("debugmodel")
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for param in model.parameters():  # norms too: every tensor differs from the job's init
            param.add_(torch.randn_like(param), alpha=0.02)
    hf = adapter().to_hf(model.state_dict())
    save_file({k: v.contiguous() for k, v in hf.items()}, f"{path}/model.safetensors")


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every DTensor gathered whole."""
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }


def train(job: Job, until: int, total: int) -> list[float]:
    if job.iterator is None:
        job.iterator = iter(job.dataloader)
    losses = []
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    while job.train_state.step < until:
        inputs, labels = next(job.iterator)
        out = job.model(inputs, positions=positions)
        if isinstance(out, DTensor):  # tensor parallel: logits sharded over the vocabulary
            out = out.full_tensor()
        loss = F.cross_entropy(out.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        job.manager.maybe_wait_for_staging()
        job.optimizers.step()
        job.schedulers.step()
        job.optimizers.zero_grad()
        job.train_state.step += 1
        job.train_state.ntokens_seen += inputs.numel()
        losses.append(float(loss.detach()))
        job.manager.save(job.train_state.step, last_step=job.train_state.step == total)
    return losses


def digests(job: Job) -> dict[str, str]:
    """A hash of every model and optimizer tensor, gathered whole (bitwise comparisons)."""
    out = {}
    items = [("model", job.model.state_dict()), ("optimizer", job.optimizers.state_dict())]
    for prefix, sd in items:
        for key, value in sd.items():
            if isinstance(value, torch.Tensor):
                full = value.full_tensor() if isinstance(value, DTensor) else value
                raw = full.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                out[f"{prefix}.{key}"] = hashlib.sha256(raw).hexdigest()
    return out
