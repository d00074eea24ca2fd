"""Resharding through S3: saved by 2 spawned ranks in several layouts, loaded by 3 in others,
over HTTP to a real (moto) server; a Checkpointer across ranks; the bytes a resharded load
reads against the bytes it needs; replicas on two nodes fetch the state once."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import unickpt
from tests.distributed import run_ranks
from unickpt.config import get_config
from unickpt.storage.s3 import S3Storage
from unickpt.tools import verify_checkpoint

from .scenarios import load_layouts, save_layouts

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KiB, MiB = 1024, 1 << 20
CONFIG = get_config(
    segment_bytes=64 * KiB, window_bytes=6 * MiB, read_piece_bytes=MiB, small_chunk_bytes=KiB
)


def _big() -> torch.Tensor:
    """24 MiB: each of two ranks uploads 12 MiB of it in two parts, in parallel."""
    return torch.randn(6 * 1024, 1024, generator=torch.Generator().manual_seed(7))


def _save(rank: int, world: int, root: str) -> None:
    save_layouts(rank, world, root, CONFIG, _big())


def _load(rank: int, world: int, root: str) -> tuple[list[str], int, int]:
    return load_layouts(rank, world, root, CONFIG, _big())


def test_reshard_through_s3(s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/reshard"
    run_ranks(2, _save, root)
    results = run_ranks(3, _load, root)
    assert [w for wrong, _, _ in results for w in wrong] == []
    read, wanted = sum(r for _, r, _ in results), sum(w for _, _, w in results)
    print(f"\nresharded loads read {read} bytes for {wanted} needed ({read / wanted:.3f}x)")
    # Every needed byte once; beyond them only the alignment padding (at most BATCH_GAP_BYTES)
    # between small chunks read together in one request.
    assert wanted <= read <= wanted * 1.0001, "the ranks of one host read each byte once"
    assert verify_checkpoint(f"{root}/layouts").ok


def _replicated() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(256, generator=g)}


def _replicas(rank: int, world: int, url: str) -> list[tuple[bool, int, int]]:
    """Each rank a node of its own loads the whole state: (values equal, bytes its S3 backend
    fetched, bytes received over the process group), reads shared across nodes and not."""
    os.environ["UNICKPT_NODE"] = f"node-{rank}"
    unickpt.save(url, _replicated(), config=CONFIG)
    out = []
    for across in (True, False):
        storage = S3Storage(url)
        dest = {k: torch.zeros_like(v) for k, v in _replicated().items()}
        config = dataclasses.replace(CONFIG, share_across_nodes=across)
        report = unickpt.load(storage, dest, config=config)
        equal = all(torch.equal(dest[k], v) for k, v in _replicated().items())
        assert report.bytes_read == storage.stats.bytes_read
        out.append((equal, storage.stats.bytes_read, report.bytes_received))
    return out


def test_replicas_on_two_nodes_fetch_the_state_once(s3_bucket: str) -> None:
    results = run_ranks(2, _replicas, f"s3://{s3_bucket}/replicas")
    nbytes = sum(t.numel() * t.element_size() for t in _replicated().values())
    shared, alone = [r[0] for r in results], [r[1] for r in results]
    assert all(equal for equal, _, _ in shared + alone)
    assert sum(n for _, n, _ in shared) == nbytes  # once, spread over the two nodes
    assert all(0 < n < nbytes for _, n, _ in shared)
    assert sum(n for _, _, n in shared) == nbytes
    assert [n for _, n, _ in alone] == [nbytes, nbytes]
