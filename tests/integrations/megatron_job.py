"""Build a small Megatron-Core GPT model (SwiGLU, grouped-query attention, local layer spec)
on CPU gloo ranks, run its forward pass, and save or load its sharded state dict with unickpt.

Megatron-Core expects CUDA in three places; the test replaces them for the run (``shim``):
``torch.cuda.current_device`` answers "cpu", the RNG tracker's ``fork`` is a no-op context, and
the forward pass gets an explicit causal ``attention_mask``. The library is not touched.
For the DistributedOptimizer, its construction sees ``torch.cuda.*`` parameter types
(``build_dist_optimizer``), ``fully_reshardable`` gathers through gloo, and a load keeps torch
Adam's ``step`` (``keep_adam_step``). The mixture-of-experts model's router finds its torch GEMM
(``shim_moe``).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch

VOCAB = 64
SEQ = 8
HIDDEN = 16


def shim() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random

    random.CudaRNGStatesTracker.fork = (  # type: ignore[method-assign]
        lambda self, name="model-parallel-rng": contextlib.nullcontext()
    )


def shim_moe() -> None:
    """Megatron's router GEMM names Transformer Engine's ``te_general_gemm``, defined only when
    Transformer Engine is installed: ``None`` selects its torch path."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def init_parallel(tp: int, pp: int = 1, ep: int = 1, expert_tp: int | None = None) -> None:
    shim()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp,
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def build_model(tp: int, pp: int = 1, seed: int = 0, **moe: Any) -> Any:
    """A GPTModel at (tp, pp); ``moe``: TransformerConfig's mixture-of-experts fields."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)  # the same on every rank: replicated parameters agree
    config = TransformerConfig(
        **moe,
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=32,
        gated_linear_unit=True,
        activation_func=F.silu,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        config,
        transformer_layer_spec=get_gpt_layer_local_spec(moe.get("num_moe_experts")),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,
    )


def logits(model: Any) -> Any:
    tokens = torch.arange(2 * SEQ).view(2, SEQ) * 7 % VOCAB
    positions = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    model.eval()
    with torch.no_grad():
        return model(tokens, positions, mask).numpy().copy()


def params(model: Any) -> dict[str, Any]:
    """The parameters by name, as NumPy arrays (sent back by value, not as shared memory)."""
    return {
        k: v.detach().numpy().copy() for k, v in model.state_dict().items() if "_extra" not in k
    }


def save_at(rank: int, world: int, path: str, tp: int, pp: int) -> dict[str, Any]:
    """Build at (tp, pp), save with unickpt; the logits (last stage) and the parameters."""
    from unickpt.integrations import megatron as um

    init_parallel(tp, pp)
    try:
        model = build_model(tp, pp, seed=1)
        um.save(model.sharded_state_dict(), path)
        return {"logits": logits(model) if pp == 1 else None, "params": params(model)}
    finally:
        destroy_parallel()


def load_at(rank: int, world: int, path: str, tp: int, pp: int) -> dict[str, Any]:
    """Build at (tp, pp) from another seed, load with unickpt; the logits and parameters."""
    from unickpt.integrations import megatron as um

    init_parallel(tp, pp)
    try:
        model = build_model(tp, pp, seed=2)
        state = um.load(model.sharded_state_dict(), path)
        model.load_state_dict(state)
        return {"logits": logits(model) if pp == 1 else None, "params": params(model)}
    finally:
        destroy_parallel()


def _cpu_tensors() -> Any:
    """Megatron's FP32Optimizer makes its loss scale with ``device='cuda'``: made on the CPU."""
    real = torch.tensor

    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return real(*args, **kwargs)

    return tensor


def build_optimizer(model: Any) -> Any:
    """Megatron's Adam (not distributed) over the model wrapped in Megatron's DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=False)
    real, torch.tensor = torch.tensor, _cpu_tensors()  # type: ignore[assignment]
    try:
        return ddp, get_megatron_optimizer(config, [ddp])
    finally:
        torch.tensor = real  # type: ignore[assignment]


def train_step(ddp: Any, optimizer: Any) -> None:
    """One Adam step; the inner torch optimizer steps (Megatron's step computes the grad
    norm on CUDA)."""
    tokens = torch.arange(2 * SEQ).view(2, SEQ) * 5 % VOCAB
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    ddp.train()
    ddp(tokens, torch.arange(SEQ).expand(2, SEQ), mask).float().square().mean().backward()
    ddp.finish_grad_sync()
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner.prepare_grads()
        inner.optimizer.step()


def adam_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """``{param name}.{exp_avg|exp_avg_sq}`` -> a copy, from the inner torch optimizers."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for p, state in inner.optimizer.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{names[id(p)]}.{k}"] = state[k].detach().numpy().copy()
    return out


def save_trained(rank: int, world: int, path: str, tp: int, pp: int) -> dict[str, Any]:
    """Build at (tp, pp), take one Adam step, save model and optimizer with unickpt."""
    from unickpt.integrations import megatron as um

    init_parallel(tp, pp)
    try:
        model = build_model(tp, pp, seed=1)
        ddp, optimizer = build_optimizer(model)
        train_step(ddp, optimizer)
        msd = model.sharded_state_dict()
        um.save({"model": msd, "optimizer": optimizer.sharded_state_dict(msd)}, path)
        return {"params": params(model), "adam": adam_state(model, optimizer)}
    finally:
        destroy_parallel()


def load_trained(rank: int, world: int, path: str, tp: int, pp: int) -> dict[str, Any]:
    """Build at (tp, pp) from another seed, load model and optimizer with unickpt."""
    from unickpt.integrations import megatron as um

    init_parallel(tp, pp)
    try:
        model = build_model(tp, pp, seed=2)
        _, optimizer = build_optimizer(model)
        msd = model.sharded_state_dict()
        osd = optimizer.sharded_state_dict(msd, is_loading=True)
        state = um.load({"model": msd, "optimizer": osd}, path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return {"params": params(model), "adam": adam_state(model, optimizer)}
    finally:
        destroy_parallel()


def _hand_state(rank: int, world: int, rows: list[list[int]], seed: int) -> dict[str, Any]:
    """Hand-made Megatron entries: ``w`` (4x6) as the given row blocks, each a tensor of its
    own; ``norm`` held whole by every rank; a per-rank ShardedObject holding a tensor; a value."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    full = torch.arange(24, dtype=torch.float32).view(4, 6) if seed == 0 else torch.zeros(4, 6)
    state: dict[str, Any] = {
        "w": [
            ShardedTensor.from_rank_offsets(
                "w", full[r0:r1].clone(), (0, r0 // (r1 - r0), 4 // (r1 - r0))
            )
            for r0, r1 in rows
        ],
        "norm": ShardedTensor.from_rank_offsets(
            "norm", torch.full((6,), float(1 - seed)), replica_id=rank
        ),
        "rng": ShardedObject(
            "rng",
            {"seed": 10 + rank - 10 * seed, "t": torch.full((3,), float(rank + 1 - seed))},
            (world,),
            (rank,),
            replica_id=0,
        ),
        "iteration": 7 - 7 * seed,
    }
    return state


def save_hand(rank: int, world: int, path: str) -> None:
    """Rank r holds rows r and r + 2 of ``w``: two blocks of one key in separate tensors."""
    from unickpt.integrations import megatron as um

    um.save(_hand_state(rank, world, [[rank, rank + 1], [rank + 2, rank + 3]], 0), path)


def load_hand(rank: int, world: int, path: str) -> dict[str, Any]:
    """Rank r holds rows 2r and 2r + 1 as one block; everything starts zeroed."""
    from unickpt.integrations import megatron as um

    state = _hand_state(rank, world, [[2 * rank, 2 * rank + 2]], 1)
    loaded = um.load(state, path)
    return {
        "w": state["w"][0].data.numpy().copy(),
        "w_returned": loaded["w"][0].numpy().copy(),
        "norm": loaded["norm"].numpy().copy(),
        "rng_seed": loaded["rng"]["seed"],
        "rng_t": loaded["rng"]["t"].numpy().copy(),
        "iteration": loaded["iteration"],
    }


def _cuda_param_types() -> Any:
    """``Parameter.type()`` as Megatron's DistributedOptimizer checks it (``torch.cuda.*``)."""
    real = torch.nn.Parameter.type

    def cuda_type(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = real(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name

    return real, cuda_type


def build_dist_optimizer(model: Any) -> Any:
    """Megatron's DistributedOptimizer (Adam) over the model in Megatron's DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True)
    real_tensor, torch.tensor = torch.tensor, _cpu_tensors()  # type: ignore[assignment]
    real_type, torch.nn.Parameter.type = _cuda_param_types()  # type: ignore[method-assign]
    try:
        return ddp, get_megatron_optimizer(config, [ddp])
    finally:
        torch.tensor = real_tensor  # type: ignore[assignment]
        torch.nn.Parameter.type = real_type  # type: ignore[method-assign]


def keep_adam_step() -> None:
    """With torch's Adam (no Transformer Engine or Apex) each parameter's state holds a
    ``step``, which Megatron's ``fully_reshardable`` load looks up among the loaded tensors
    (saved without it): the step the optimizer holds is kept, as the other loads do."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    real = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(real, "keeps_step", False):
        return

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state[main].get("step")
        real(self, model_param, tensors if step is None else {"step": step, **tensors})

    set_states.keeps_step = True  # type: ignore[attr-defined]
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states  # type: ignore[method-assign]


def dist_train_step(ddp: Any, optimizer: Any) -> None:
    """One step: gradients reduce-scattered over data parallelism, each rank's Adam steps its
    range, the parameters all-gathered."""
    tokens = torch.arange(2 * SEQ).view(2, SEQ) * 5 % VOCAB
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    ddp.train()
    ddp(tokens, torch.arange(SEQ).expand(2, SEQ), mask).float().square().mean().backward()
    ddp.finish_grad_sync()
    for inner in optimizer.chained_optimizers:
        inner.prepare_grads()
        inner.step_with_ready_grads()


_DIST_STATES = (("param", "fp32_param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))


def dist_adam_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """``{param name}.{fp32_param|exp_avg|exp_avg_sq}`` -> (start of this rank's range in the
    flattened parameter, the parameter's shape, a copy of the range's values)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for inner in optimizer.chained_optimizers:
        for param in inner.model_param_group_index_map:
            start = inner._get_model_param_range_map(param)["param"].start
            tensors = inner._get_main_param_and_optimizer_states(param)
            for k, name in _DIST_STATES:
                values = tensors[k].detach().numpy().copy()
                out[f"{names[id(param)]}.{name}"] = (start, tuple(param.shape), values)
    return out


def _dist_metadata(sharding_type: str) -> dict[str, Any]:
    # fully_reshardable gathers over data parallelism: through gloo (to DP rank 0) on CPU
    return {
        "distrib_optim_sharding_type": sharding_type,
        "distrib_optim_fully_reshardable_mem_efficient": True,
    }


def _dist_step(step: tuple[str, str, int, str]) -> dict[str, Any]:
    """Save (a model trained one step) or load (into a model of another seed) model and
    distributed optimizer at TP ``tp``, the rest of the world data parallel."""
    from unickpt.integrations import megatron as um

    what, path, tp, sharding_type = step
    pickled = sharding_type == "dp_reshardable"  # its per_bucket_numel: dicts keyed by dtypes
    init_parallel(tp, 1)
    try:
        model = build_model(tp, 1, seed=1 if what == "save" else 2)
        ddp, optimizer = build_dist_optimizer(model)
        msd = model.sharded_state_dict()
        if what == "save":
            dist_train_step(ddp, optimizer)
            osd = optimizer.sharded_state_dict(msd, metadata=_dist_metadata(sharding_type))
            um.save({"model": msd, "optimizer": osd}, path, allow_pickle=pickled)
        else:
            keep_adam_step()
            for inner in optimizer.chained_optimizers:  # Adam's state, as Megatron-LM's load
                inner._init_optimizer_states_with_dummy_values()
            meta = _dist_metadata(sharding_type)
            osd = optimizer.sharded_state_dict(msd, is_loading=True, metadata=meta)
            state = um.load({"model": msd, "optimizer": osd}, path, allow_pickle=pickled)
            model.load_state_dict(state["model"])
            with torch.no_grad():  # fp32 main params are views of the parameters
                optimizer.load_state_dict(state["optimizer"])
        return dist_adam_state(model, optimizer)
    finally:
        destroy_parallel()


def dist_steps(rank: int, world: int, steps: list[tuple[str, str, int, str]]) -> list[Any]:
    """``_dist_step`` for each of ``steps`` (what, path, tp, sharding type), in order."""
    return [_dist_step(step) for step in steps]


EXPERTS = 4


def build_moe_model(tp: int, ep: int, expert_tp: int, seed: int) -> Any:
    """The GPTModel with a mixture of experts in each layer: 4 SwiGLU experts (the local
    spec's SequentialMLP), 2 chosen per token, split over ``ep`` expert-parallel ranks and
    ``expert_tp`` tensor-parallel ranks; no biases (Megatron allows MoE biases only at
    expert TP 1). Megatron initializes each expert-parallel rank's experts alike (expert 2 at
    EP=2 equals expert 0): each expert's parameters are scaled by 1 + its global index, so
    that an expert loaded in the place of another is seen."""
    model = build_model(
        tp,
        seed=seed,
        num_moe_experts=EXPERTS,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp,
        add_bias_linear=False,
    )
    with torch.no_grad():
        for name, param in global_expert_names(model.named_parameters()).items():
            param.mul_(1 + _expert_index(name))
    return model


def _expert_index(name: str) -> int:
    """The global index of the expert a parameter belongs to; 0 for other parameters."""
    found = re.search(r"\.experts\.(\d+)\.", name)
    return int(found.group(1)) if found else 0


def global_expert_names(named: Any) -> dict[str, Any]:
    """``named`` (name, value pairs) with each local expert named by its global index:
    ``experts.local_experts.{i}.`` -> ``experts.{e}.``."""
    from megatron.core import parallel_state

    per_rank = EXPERTS // parallel_state.get_expert_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * per_rank
    return {
        re.sub(r"local_experts\.(\d+)\.", lambda m: f"{first + int(m.group(1))}.", k): v
        for k, v in named
    }


def _moe_step(step: tuple[str, str, int, int, int]) -> dict[str, Any]:
    """Save (seed 1) or load (into a model of seed 2) the MoE model at (tp, ep, expert_tp);
    its logits and parameters."""
    from unickpt.integrations import megatron as um

    what, path, tp, ep, expert_tp = step
    init_parallel(tp, 1, ep, expert_tp)
    shim_moe()
    try:
        model = build_moe_model(tp, ep, expert_tp, seed=1 if what == "save" else 2)
        if what == "save":
            um.save(model.sharded_state_dict(), path)
        else:
            model.load_state_dict(um.load(model.sharded_state_dict(), path))
        return {"logits": logits(model), "params": global_expert_names(params(model).items())}
    finally:
        destroy_parallel()


def moe_steps(rank: int, world: int, steps: list[tuple[str, str, int, int, int]]) -> list[Any]:
    """``_moe_step`` for each of ``steps`` (what, path, tp, ep, expert tp), in order."""
    return [_moe_step(step) for step in steps]


def one_rank_fails(rank: int, world: int, path: str) -> list[str]:
    """A save whose state dict on rank 1 holds a flattened range (refused while mapping it),
    a save that works, then a load from a folder rank 1 does not find: each failure is
    raised on every rank, as that rank's error, with no rank waiting for the others."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from unickpt.config import get_config
    from unickpt.errors import CheckpointError
    from unickpt.integrations import megatron as um

    config = get_config(collective_timeout_s=20)  # a rank left waiting gives up soon
    bad = _hand_state(rank, world, [[rank, rank + 1], [rank + 2, rank + 3]], 0)
    if rank == 1:
        sh = ShardedTensor.from_rank_offsets("optimizer.exp_avg.w", torch.zeros(4, 6))
        sh.flattened_range = slice(3, 9)
        sh.data = torch.zeros(6)
        bad["optimizer"] = sh
    good = _hand_state(rank, world, [[rank, rank + 1], [rank + 2, rank + 3]], 0)
    into = _hand_state(rank, world, [[2 * rank, 2 * rank + 2]], 1)
    outcomes = []
    for attempt in (
        lambda: um.save(bad, path, config=config),
        lambda: um.save(good, path, config=config),
        lambda: um.load(into, path if rank == 0 else f"{path}-elsewhere", config=config),
    ):
        try:
            attempt()
            outcomes.append("done")
        except CheckpointError as e:
            outcomes.append(str(e))
    return outcomes
