"""Hugging Face safetensors models: online load into tensor parallelism, and sharded save.

A Llama-shaped bf16 model (``--mb`` MiB, one file as ``save_pretrained`` writes it up to 5 GB)
is loaded on ``--world`` CPU ranks (gloo) into DTensors split as Megatron-style tensor
parallelism (q, k, v, gate, up by rows; o, down by columns; norms replicated) by:

- ``unickpt``: ``unickpt.load(folder, state)``, each rank reading the bytes it holds;
- ``dcp_hf``: ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader``;
- ``safe_open``: ``safetensors.safe_open`` + ``get_tensor`` + a copy of the rank's part.

Then the model, split by rows (FSDP2's layout), is saved as safetensors by ``unickpt.save(...,
format="safetensors")`` and by DCP's ``HuggingFaceStorageWriter`` with consolidation into one
file. Times are the slowest rank's, medians of ``--runs`` rounds (after a warm-up round), the
page cache warm. Bytes read are unickpt's report summed over ranks; ``safe_open`` reads every
tensor whole on every rank (its figure is computed); DCP reports none.

python benchmarks/hf_load.py --mb 1024 --world 2 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import unickpt

LOADS = ("unickpt", "dcp_hf", "safe_open")
SAVES = ("unickpt_save", "dcp_hf_save")


def shapes(total_bytes: int, d: int = 1024) -> dict[str, tuple[int, ...]]:
    """Llama blocks (bf16) until ``total_bytes``: attention, gated MLP, two norms."""
    f = 11 * d // 4
    block = {
        "self_attn.q_proj.weight": (d, d),
        "self_attn.k_proj.weight": (d, d),
        "self_attn.v_proj.weight": (d, d),
        "self_attn.o_proj.weight": (d, d),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    out: dict[str, tuple[int, ...]] = {}
    i = 0
    while sum(2 * _numel(s) for s in out.values()) < total_bytes:
        out.update({f"model.layers.{i}.{k}": s for k, s in block.items()})
        i += 1
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def tp_placement(key: str, ndim: int) -> Any:
    if ndim == 1:
        return Replicate()
    return Shard(1) if ("o_proj" in key or "down_proj" in key) else Shard(0)


def _full(key: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def _dest(mesh: Any, sizes: dict[str, tuple[int, ...]], rows: bool) -> dict[str, DTensor]:
    out = {}
    for k, s in sizes.items():
        placement = Shard(0) if rows else tp_placement(k, len(s))
        out[k] = distribute_tensor(torch.zeros(s, dtype=torch.bfloat16), mesh, [placement])
    return out


def _load_safe_open(folder: str, state: dict[str, DTensor]) -> int:
    read = 0
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        for k, dt in state.items():
            whole = f.get_tensor(k)
            read += whole.numel() * whole.element_size()
            local = dt.to_local()
            shard = dt.placements[0]
            if isinstance(shard, Shard):
                n = whole.shape[shard.dim] // dt.device_mesh.size()
                part = whole.narrow(shard.dim, dt.device_mesh.get_local_rank() * n, n)
            else:
                part = whole
            local.copy_(part)
    return read


def _load_dcp(folder: str, state: dict[str, DTensor]) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    dcp.load(state, storage_reader=HuggingFaceStorageReader(folder))
    return 0


def _save_dcp(folder: str, state: dict[str, DTensor]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    writer = HuggingFaceStorageWriter(
        folder,
        fqn_to_index_mapping=dict.fromkeys(state, 1),
        save_distributed=True,
        enable_consolidation=True,
    )
    dcp.save(state, storage_writer=writer)


def _timed(fn: Callable[[], int]) -> tuple[float, int]:
    dist.barrier()
    start = time.perf_counter()
    read = fn()
    dist.barrier()
    return time.perf_counter() - start, read


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    sizes = shapes(args.mb * 2**20)
    folder = os.path.join(args.dir, "hf")
    if rank == 0:
        full = {k: _full(k, s, i) for i, (k, s) in enumerate(sizes.items())}
        os.makedirs(folder, exist_ok=True)
        save_file(full, os.path.join(folder, "model.safetensors"), {"format": "pt"})
        del full
    dist.barrier()
    dest = _dest(mesh, sizes, rows=False)
    held = sum(t.to_local().numel() * 2 for t in dest.values())
    loads: dict[str, Callable[[], int]] = {
        "unickpt": lambda: unickpt.load(folder, dest).bytes_read,
        "dcp_hf": lambda: _load_dcp(folder, dest),
        "safe_open": lambda: _load_safe_open(folder, dest),
    }
    source = _dest(mesh, sizes, rows=True)
    for t in source.values():
        t.to_local().normal_()
    targets = {
        "unickpt_save": os.path.join(args.dir, "u"),
        "dcp_hf_save": os.path.join(args.dir, "d"),
    }

    def save_unickpt() -> int:
        unickpt.save(targets["unickpt_save"], source, format="safetensors")
        return 0

    def save_dcp() -> int:
        _save_dcp(targets["dcp_hf_save"], source)
        return 0

    saves: dict[str, Callable[[], int]] = {"unickpt_save": save_unickpt, "dcp_hf_save": save_dcp}
    rows: list[dict[str, Any]] = []
    for run in range(args.runs + 1):
        for case, fn in {**loads, **saves}.items():
            if case in targets and rank == 0:
                shutil.rmtree(targets[case], ignore_errors=True)  # outside the timing
            try:
                s, read = _timed(fn)
            except Exception as e:  # noqa: BLE001 - a system that fails is reported, not fatal
                rows.append(dict(run=run, case=case, error=f"{type(e).__name__}: {e}"[:200]))
                continue
            rows.append(dict(run=run, case=case, s=s, read=read, held=held))
    q.put((rank, rows))
    dist.destroy_process_group()


def _summary(per_rank: list[list[dict[str, Any]]], runs: int, mb: int) -> dict[str, Any]:
    out: dict[str, Any] = {"model_mib": mb}
    for case in (*LOADS, *SAVES):
        mine = [r for rows in per_rank for r in rows if r["case"] == case and r["run"] > 0]
        errors = [r["error"] for r in mine if "error" in r]
        if errors:
            out[case] = {"error": errors[0]}
            continue
        times = [max(r["s"] for r in mine if r["run"] == run) for run in range(1, runs + 1)]
        row: dict[str, Any] = dict(median_s=statistics.median(times), min_s=min(times),
                                   max_s=max(times))  # fmt: skip
        last = [r for r in mine if r["run"] == runs]
        if case in LOADS and case != "dcp_hf":
            row["read_over_needed"] = sum(r["read"] for r in last) / sum(r["held"] for r in last)
        out[case] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="model size in MiB (bf16)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="measured rounds (after a warm-up)")
    parser.add_argument("--dir", default=None, help="folder for the files (default: a temp)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(r, args.world, port, args, q))
            for r in range(args.world)
        ]
        for p in procs:
            p.start()
        results = sorted(q.get() for _ in procs)
        for p in procs:
            p.join()
    print(json.dumps(_summary([rows for _, rows in results], args.runs, args.mb), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
