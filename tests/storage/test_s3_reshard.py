"""Resharding through S3: saved by 2 spawned ranks in several layouts, loaded by 3 in others,
over HTTP to a real (moto) server; a Checkpointer across ranks; the bytes a resharded load
reads against the bytes it needs."""

from __future__ import annotations

import pytest
import torch

import unickpt
from tests.api.layouts_zoo import LAYOUTS, global_tensors, local_of, zeroed
from tests.distributed import run_ranks
from unickpt.config import get_config
from unickpt.tools import verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KiB, MiB = 1024, 1 << 20
CONFIG = get_config(
    segment_bytes=64 * KiB, window_bytes=6 * MiB, read_piece_bytes=MiB, small_chunk_bytes=KiB
)
SAVE_LAYOUTS = ("dt_row", "megatron", "flat", "replicated")
LOAD_LAYOUTS = ("dt_col", "flat", "replicated")


def _big() -> torch.Tensor:
    """24 MiB: each of two ranks uploads 12 MiB of it in two parts, in parallel."""
    return torch.randn(6 * 1024, 1024, generator=torch.Generator().manual_seed(7))


def _save(rank: int, world: int, root: str) -> None:
    tensors = global_tensors()
    state = {
        lay: {n: LAYOUTS[lay](t, rank, world) for n, t in tensors.items()} for lay in SAVE_LAYOUTS
    }
    state["big"] = LAYOUTS["dt_row"](_big(), rank, world)
    unickpt.save(f"{root}/layouts", state, config=CONFIG)
    with unickpt.Checkpointer(f"{root}/run", keep_last=1, config=CONFIG) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": LAYOUTS["dt_row"](tensors["a"] * step, rank, world)})


def _load(rank: int, world: int, root: str) -> tuple[list[str], int, int]:
    tensors = global_tensors()
    wrong = []
    read = wanted = 0
    for dest_layout in LOAD_LAYOUTS:
        make = LAYOUTS[dest_layout]
        state = {
            lay: {n: zeroed(make(t, rank, world)) for n, t in tensors.items()}
            for lay in SAVE_LAYOUTS
        }
        state["big"] = zeroed(make(_big(), rank, world))
        report = unickpt.load(f"{root}/layouts", state, config=CONFIG)
        read, wanted = read + report.bytes_read, wanted + report.bytes_wanted
        for lay in SAVE_LAYOUTS:
            for n, t in tensors.items():
                if not torch.equal(local_of(state[lay][n]), local_of(make(t, rank, world))):
                    wrong.append(f"{lay} -> {dest_layout}@{world}: {n}")
        if not torch.equal(local_of(state["big"]), local_of(make(_big(), rank, world))):
            wrong.append(f"big -> {dest_layout}@{world}")
    ckpt = unickpt.Checkpointer(f"{root}/run")
    dest = {"w": zeroed(LAYOUTS["flat"](tensors["a"], rank, world))}
    if ckpt.load_latest(dest) != 2 or ckpt.steps() != [2]:
        wrong.append(f"steps {ckpt.steps()}")
    if not torch.equal(
        local_of(dest["w"]), local_of(LAYOUTS["flat"](tensors["a"] * 2, rank, world))
    ):
        wrong.append("checkpointer step 2")
    return wrong, read, wanted


def test_reshard_through_s3(s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/reshard"
    run_ranks(2, _save, root)
    results = run_ranks(3, _load, root)
    assert [w for wrong, _, _ in results for w in wrong] == []
    read, wanted = sum(r for _, r, _ in results), sum(w for _, _, w in results)
    print(f"\nresharded loads read {read} bytes for {wanted} needed ({read / wanted:.3f}x)")
    assert verify_checkpoint(f"{root}/layouts").ok
