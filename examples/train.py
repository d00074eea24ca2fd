"""Plain PyTorch training with unickpt checkpoints, under FSDP2 or DDP, on CPU (gloo).

A small MLP with dropout learns a synthetic task. The state (model, optimizer, step, every
rank's random generators) is saved every ``--save-every`` steps by a ``unickpt.Checkpointer``
and at the last step; a run started again with the same ``--out`` resumes from the newest
intact checkpoint, under either parallelism and on any number of processes:

    torchrun --nproc-per-node 2 examples/train.py --parallel fsdp2 --steps 8 --out runs/mlp
    # stop it (or let it finish), then go on to step 16, under DDP this time:
    torchrun --nproc-per-node 2 examples/train.py --parallel ddp --steps 16 --out runs/mlp

Rank 0 prints one line per step (``step N loss X``). Resumed on the world size that saved it,
under the same parallelism, the losses are those of an uninterrupted run, bit for bit (the
batch of a step depends on the step alone, the dropout masks on the restored generators).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import unickpt

FEATURES, CLASSES, GLOBAL_BATCH = 32, 8, 64


def build_model(parallel: str) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(FEATURES, 128),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(128, 128),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(128, CLASSES),
    )
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step`` (the same at any world size)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=g)
    y = (x[:, :CLASSES] + 0.1 * torch.randn(GLOBAL_BATCH, CLASSES, generator=g)).argmax(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    return x.chunk(world)[rank], y.chunk(world)[rank]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parallel", choices=("fsdp2", "ddp"), default="fsdp2")
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--out", default="runs/mlp", help="the Checkpointer's root")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
    else:  # one process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = build_model(args.parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = {"model": model, "optimizer": optimizer, "train": {"step": 0}}
    state["rng"] = unickpt.RNGState()  # dropout masks continue where the saved run was

    ckpt = unickpt.Checkpointer(args.out, keep_last=3)
    last = ckpt.load_latest(state)  # None: nothing saved yet
    start = 1 if last is None else last + 1
    if dist.get_rank() == 0:
        print("started fresh" if last is None else f"resumed from step {last}", flush=True)
    model.train()
    for step in range(start, args.steps + 1):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if dist.get_rank() == 0:
            print(f"step {step} loss {mean.item() / dist.get_world_size()!r}", flush=True)
        state["train"]["step"] = step
        if step % args.save_every == 0:
            ckpt.save(step, state)  # asynchronous: training goes on while it is written
    if start <= args.steps:
        ckpt.close(final_step=args.steps, state=state)  # the last step too, unless just saved
    else:
        ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
