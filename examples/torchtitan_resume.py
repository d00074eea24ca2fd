"""torchtitan through unickpt: its debug model under FSDP2 on 2 CPU processes saves every 2 steps;
a second job resumes from step 4 and ends where the uninterrupted one ended; under a minute.

pip install -e ".[torchtitan]" && python examples/torchtitan_resume.py

torchtitan assumes an accelerator: on CPU its device type is set to ``cpu``, attention uses its
SDPA module (flex attention has no CPU backward) and FSDP reduces gradients with a plain sum
(gloo has no PREMUL_SUM). On GPUs only the one-line switch below is needed.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchtitan.distributed.parallel_dims as parallel_dims_module
import torchtitan.tools.utils as titan_utils

titan_utils.device_type = "cpu"
parallel_dims_module.device_type = "cpu"

from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed.activation_checkpoint import SelectiveAC  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from unickpt.integrations.torchtitan import UnickptCheckpointManager  # noqa: E402

SEQ, BATCH, VOCAB, STEPS = 32, 2, 2048, 6


class TrainState:
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


def job(rank: int, world: int, folder: str, resume_from: int | None, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    spec = model_registry("debugmodel")
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_shard_degree=-1)
    training = TrainingConfig(
        mixed_precision_param="float32", seq_len=SEQ, local_batch_size=BATCH, steps=STEPS
    )
    spec.model.update_from_config(
        config=Trainer.Config(model_spec=spec, parallelism=parallelism, training=training)
    )
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model,
        parallel_dims=ParallelDims.from_config(parallelism, world),
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=SelectiveAC.Config(),
        dump_folder=folder,
    )
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    adamw = default_adamw(lr=8e-4)
    adamw.implementation = "for-loop"
    optimizers = adamw.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=STEPS
    )
    state = TrainState()
    # The one-line switch: unickpt's manager in place of torchtitan's DCP CheckpointManager.
    manager = UnickptCheckpointManager.Config(
        enable=True, folder="ckpt", interval=2, keep_latest_k=2, async_mode="async_with_pinned_mem"
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=folder,
    )
    if resume_from is not None:
        assert manager.load(step=resume_from)
    losses = []
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    while state.step < STEPS:
        g = torch.Generator().manual_seed(1000 * rank + state.step)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        logits = model(tokens[:, :-1], positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        manager.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.step += 1
        losses.append(round(float(loss.detach()), 6))
        manager.save(state.step, last_step=state.step == STEPS)
    manager.close()
    if rank == 0:
        out.put(losses)
    dist.destroy_process_group()


def run(folder: str, resume_from: int | None) -> list[float]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(job, args=(2, folder, resume_from, queue), nprocs=2, start_method="spawn")
    return queue.get()


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        reference = run(root, None)
        print("uninterrupted losses:", reference)
        print("checkpoints:", sorted(os.listdir(os.path.join(root, "ckpt"))))
        resumed = run(root, 4)
        print("resumed from step 4: ", resumed)
        print("the resumed steps match the uninterrupted run:", resumed == reference[4:])


if __name__ == "__main__":
    main()
