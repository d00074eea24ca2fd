"""Write DeepSpeed ZeRO checkpoints (stages 1-3) with DeepSpeed itself on 2 gloo ranks (CPU
accelerator, torch's AdamW as the client optimizer, no compiled ops)."""

from __future__ import annotations

import os
from typing import Any

import torch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.hidden = torch.nn.Linear(6, 7)
        self.out = torch.nn.Linear(7, 3, bias=False)
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(x)))) * self.scale


def save_deepspeed(rank: int, world: int, root: str, stages: list[int]) -> dict[int, Any]:
    """Train each stage 2 steps and save; what DeepSpeed says the full values are."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(rank)
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # DeepSpeed's shared-memory allreduce for CPU ranks is an op it compiles when its backend
    # starts (about a minute of C++ builds, again whenever its build cache is cold or was built
    # for another environment); without it DeepSpeed reduces through gloo, as it does where the
    # op cannot be built. The op moves no checkpoint bytes: the job and its files are the same.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    out = {}
    for stage in stages:
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=net, optimizer=opt, lr_scheduler=sched, config=config
        )
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            x = torch.randint(0, 11, (2, 5), generator=g)
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
        # the (empty) universal-checkpoint info lets ds_to_universal convert the checkpoint
        info = {"universal_checkpoint_info": {}}
        engine.save_checkpoint(f"{root}/stage{stage}", tag="global_step2", client_state=info)
        full: dict[str, Any] = {}
        for name, p in engine.module.named_parameters():
            full[name] = [  # lists: tensors would not outlive this process in the queue
                safe_get_full_fp32_param(p).tolist(),
                safe_get_full_optimizer_state(p, "exp_avg").tolist(),
                safe_get_full_optimizer_state(p, "exp_avg_sq").tolist(),
            ]
        out[stage] = full
    return out
