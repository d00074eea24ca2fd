"""Rank functions of the format tests (spawned processes import them from here)."""

from __future__ import annotations

import math
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import unickpt


def tp_placement(key: str, t: torch.Tensor) -> Any:
    """Megatron-style tensor parallelism: column-parallel weights split rows, row-parallel
    ones columns, the rest replicated."""
    if t.ndim == 2 and any(p in key for p in ("o_proj", "down_proj")):
        return Shard(1)
    if t.ndim == 2:
        return Shard(0)
    return Replicate()


def _reference(path: str) -> dict[str, torch.Tensor]:
    out = {}
    with safe_open(path, "pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            out[k] = f.get_tensor(k)
    return out


def load_tp(rank: int, world: int, folder: str, single_file: str) -> tuple[int, int, bool]:
    """Load a safetensors model into DTensors split over ``world`` ranks; compare with the file
    read whole; (bytes read, bytes held, all equal)."""
    mesh = init_device_mesh("cpu", (world,))
    ref = _reference(single_file)
    state: dict[str, Any] = {}
    held = 0
    for k, t in ref.items():
        dt = distribute_tensor(torch.zeros_like(t), mesh, [tp_placement(k, t)])
        state["m." + k] = dt
        held += dt.to_local().numel() * t.element_size()
    report = unickpt.load(folder, state, keys=lambda k: "m." + k)
    equal = all(
        torch.equal(state["m." + k].full_tensor().view(torch.uint8), t.view(torch.uint8))
        for k, t in ref.items()
    )
    return report.bytes_read, held, equal and bool(report.unverified_files)


def save_rows(rank: int, world: int, model_file: str, out: str, max_shard: str) -> int:
    """Save a model's state (read from ``model_file``, tied weights kept tied) split by rows
    over ``world`` ranks (FSDP2's layout), as safetensors."""
    mesh = init_device_mesh("cpu", (world,))
    full = torch.load(model_file, weights_only=True)
    made: dict[int, DTensor] = {}
    state: dict[str, Any] = {}
    for k, t in full.items():
        key = t.untyped_storage().data_ptr()
        if key not in made:
            made[key] = distribute_tensor(t, mesh, [Shard(0)] if t.ndim else [Replicate()])
        state[k] = made[key]
    report = unickpt.save(out, state, format="safetensors", max_shard_size=max_shard)
    return report.bytes_written


def bytes_of(state: dict[str, torch.Tensor]) -> int:
    return sum(math.prod(t.shape) * t.element_size() for t in state.values())


def dcp_full() -> dict[str, torch.Tensor]:
    """The tensors the DCP tests save, the same in every process."""
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(8, 6, generator=g),
        "h": torch.randn(5, 4, generator=g).to(torch.bfloat16),
        "b": torch.arange(6, dtype=torch.int64),
    }


def dcp_save(rank: int, world: int, folder: str) -> None:
    """Save with torch.distributed.checkpoint from ``world`` ranks: rows split, one tensor
    replicated, one plain value."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (world,))
    full = dcp_full()
    state = {
        "model": {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "h": distribute_tensor(full["h"], mesh, [Shard(1)]),
            "b": full["b"].clone(),
        },
        "step": 7,
    }
    dcp.save(state, checkpoint_id=folder)


def dcp_load(rank: int, world: int, folder: str) -> tuple[bool, int, int]:
    """Load the DCP folder online into columns split over ``world`` ranks; (all equal, bytes
    read, bytes held)."""
    mesh = init_device_mesh("cpu", (world,))
    full = dcp_full()
    state: dict[str, Any] = {
        "model": {
            "w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]),
            "h": distribute_tensor(torch.zeros(5, 4, dtype=torch.bfloat16), mesh, [Shard(0)]),
            "b": torch.zeros(6, dtype=torch.int64),
        },
        "step": 0,
    }
    report = unickpt.load(folder, state)
    m = state["model"]
    equal = (
        torch.equal(m["w"].full_tensor(), full["w"])
        and torch.equal(m["h"].full_tensor(), full["h"])
        and torch.equal(m["b"], full["b"])
        and state["step"] == 7
    )
    held = sum(
        (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()
        for t in m.values()
    )
    return equal, report.bytes_read, held


def load_forged(folders: list[str], out: str) -> None:
    """Load each forged DCP folder online (``unickpt.load``) and convert it (``import_dcp``),
    in this process; write, per folder and way, the error raised (type and message) and
    whether the process's classes and DCP's enum members were left as they were."""
    import json

    from unickpt.tools import import_dcp

    from ..tools.forged_pickle import process_state

    before = process_state()
    found: dict[str, Any] = {}
    for folder in folders:
        for way in ("load", "convert"):
            state = {"model": {k: torch.zeros_like(v) for k, v in dcp_full().items()}, "step": 0}
            error = ""
            try:
                if way == "load":
                    unickpt.load(folder, state)
                else:
                    import_dcp(folder, f"{folder}-converted")
            except Exception as e:  # noqa: BLE001 - reported to the test
                error = f"{type(e).__name__}: {e}"
            found[f"{folder.rsplit('/', 1)[-1]} {way}"] = {
                "error": error,
                "untouched": process_state() == before,
            }
    with open(out, "w") as f:  # not through pathlib: a forgery that passed may have steered it
        json.dump(found, f)


SHARD_SIZES = {"one file": "1MB", "two shards": "13KB", "three shards": "9KB"}
"""``max_shard_size`` of :func:`overwrite_model`'s layouts (six tensors of 4 KiB)."""


def overwrite_model(seed: int) -> dict[str, torch.Tensor]:
    """Six tensors of 4 KiB, every one different for each seed."""
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": torch.randn(32, 32, generator=g) + 100 * seed for i in range(6)}


def save_model(folder: str, seed: int, layout: str) -> None:
    unickpt.save(
        folder,
        overwrite_model(seed),
        format="safetensors",
        max_shard_size=SHARD_SIZES[layout],
        overwrite=True,
    )


def overwrite_killed(folder: str, seed: int, layout: str, kill_at: int, steps_file: str) -> None:
    """Overwrite the model in ``folder`` and die by SIGKILL just before its ``kill_at``-th
    rename, link or removal in ``folder`` (0: never); write how many there were."""
    import os
    import signal

    steps = 0

    def counted(call: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal steps
            if str(args[0]).startswith(folder + "/"):
                steps += 1
                if steps == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return call(*args, **kwargs)

        return run

    for name in ("replace", "rename", "link", "unlink", "remove"):
        setattr(os, name, counted(getattr(os, name)))
    save_model(folder, seed, layout)
    with open(steps_file, "w") as f:
        f.write(str(steps))


def overwrite_forever(folder: str, ready: str) -> None:
    """Overwrite the model in ``folder`` again and again, seeds 1 and 2 in turn, each in
    another layout; ``ready`` is created once the first overwrite is done."""
    layouts = list(SHARD_SIZES)
    for i in range(10**6):
        save_model(folder, 1 + i % 2, layouts[i % 3])
        if i == 0:
            open(ready, "w").close()
