"""Write a Megatron-Core torch_dist checkpoint with megatron-core itself, on gloo ranks.

Megatron's save calls two CUDA functions; on CPU they are replaced for the run (a no-op
``synchronize`` and ``current_device`` answering "cpu"), nothing else.
"""

from __future__ import annotations

from typing import Any

import torch


def full_tensors() -> dict[str, torch.Tensor]:
    return {
        "decoder.final_norm.weight": torch.linspace(0, 1, 6),
        "decoder.linear_qkv.weight": torch.arange(8 * 6, dtype=torch.float32).view(8, 6),
        "decoder.layers.mlp.weight": torch.arange(3 * 4 * 2, dtype=torch.bfloat16).view(3, 4, 2),
    }


def save_megatron(rank: int, world: int, path: str) -> None:
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    full = full_tensors()
    qkv = full["decoder.linear_qkv.weight"].chunk(world, 0)[rank].clone()  # column parallel
    layers = full["decoder.layers.mlp.weight"]
    state: dict[str, Any] = {
        "norm": ShardedTensor.from_rank_offsets(
            "decoder.final_norm.weight", full["decoder.final_norm.weight"].clone(), replica_id=rank
        ),
        "qkv": ShardedTensor.from_rank_offsets("decoder.linear_qkv.weight", qkv, (0, rank, world)),
        "rng": ShardedObject("rng_state", {"seed": 1234 + rank}, (world,), (rank,), replica_id=0),
        "iteration": 7,
        "args": {"lr": 0.1, "tensor_model_parallel_size": world},
    }
    for i in range(3):  # a layer-stacked tensor: one block per layer, row parallel inside
        local = layers[i].chunk(world, 1)[rank].clone()
        state[f"layer{i}"] = ShardedTensor.from_rank_offsets(
            "decoder.layers.mlp.weight", local, (0, i, 3), (2, rank, world), prepend_axis_num=1
        )
    dist_checkpointing.save(state, path)
