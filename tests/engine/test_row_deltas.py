"""Embedding tables saved as changed rows only, on top of a base."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import unickpt
from unickpt.engine.incremental import changed_runs, row_digests
from unickpt.engine.tensor_reader import CheckpointReader
from unickpt.layouts.boxes import Box
from unickpt.tools.verify import verify_checkpoint

ROWS, DIM = 20_000, 16


def test_row_digests_see_every_byte() -> None:
    for dtype, dim in ((torch.float32, 16), (torch.float16, 3), (torch.uint8, 5)):
        table = torch.arange(50 * dim).reshape(50, dim).to(dtype)
        raw = table.view(torch.uint8).reshape(-1)
        before = row_digests(raw, 50)
        assert before.unique().numel() == 50
        for pos in (0, raw.numel() // 2, raw.numel() - 1):
            changed = raw.clone()
            changed[pos] ^= 1
            diff = (row_digests(changed, 50) != before).nonzero().flatten().tolist()
            assert diff == [pos // (raw.numel() // 50)], (dtype, pos)
    mask = torch.tensor([True, True, False, True, False, False])
    assert changed_runs(mask) == [(0, 2, True), (2, 3, False), (3, 4, True), (4, 6, False)]


def _zipf_ids(gen: torch.Generator, n: int) -> torch.Tensor:
    ranks = torch.arange(1, ROWS + 1, dtype=torch.float64)
    weights = 1.0 / ranks**1.1
    ids = torch.multinomial(weights, n, replacement=True, generator=gen)
    return (ids * 7919) % ROWS  # hot ids spread over the table


def test_changed_rows_only_load_and_reshard(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    table = nn.Embedding(ROWS, DIM, sparse=True)
    opt = torch.optim.SGD(table.parameters(), lr=0.1)
    ckpt = unickpt.Checkpointer(
        tmp_path, incremental=True, full_every=5, mode="sync", row_deltas=["tables.*"]
    )
    row_bytes = DIM * 4
    for step in range(6):
        before = table.weight.detach().clone()
        for _ in range(3):
            table(_zipf_ids(gen, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
        changed = int((table.weight != before).any(dim=1).sum())
        report = ckpt.save(step, {"tables": table}).wait()
        assert report is not None
        if step % 5 == 0:
            assert report.bytes_written == ROWS * row_bytes, "a full save writes the table"
        else:
            assert changed * row_bytes <= report.bytes_written, (step, changed)
            assert report.bytes_written <= changed * row_bytes + 64 * changed, (step, changed)
            assert report.bytes_written < ROWS * row_bytes / 10
        fresh = nn.Embedding(ROWS, DIM)
        unickpt.load(ckpt.path(step), {"tables": fresh})
        assert torch.equal(fresh.weight, table.weight), step
        if step == 4:
            at_4 = table.weight.detach().clone()
    assert verify_checkpoint(ckpt.path(4)).ok

    with CheckpointReader(ckpt.path(4)) as reader:
        assert len(reader.metadata.tensors["tables.weight"].chunks) > 10
        part = reader.read_tensor("tables.weight", box=Box((5_003, 2), (7_000, 9)))
        assert torch.equal(part, at_4[5_003:12_003, 2:11])
    half = torch.zeros(ROWS // 2, DIM)
    shard = unickpt.ShardedTensor(half, (ROWS, DIM), (ROWS // 2, 0))
    unickpt.load(ckpt.path(4), {"tables": {"weight": shard}})
    assert torch.equal(half, at_4[ROWS // 2 :])
    ckpt.close()


def test_dense_changes_write_the_table_whole(tmp_path: Path) -> None:
    table = torch.zeros(4_000, 8)
    frozen = torch.ones(4_000, 8)
    ckpt = unickpt.Checkpointer(
        tmp_path, incremental=True, mode="sync", row_deltas=["*"], full_every=100
    )
    written = []
    for step in range(4):
        if step == 2:
            table += 1.0  # every row changes: more than half, so a new base
        else:
            table[step * 7] += 1.0
        report = ckpt.save(step, {"t": table, "f": frozen}).wait()
        assert report is not None
        written.append(report.bytes_written)
        dest = {"t": torch.empty(4_000, 8), "f": torch.empty(4_000, 8)}
        unickpt.load(ckpt.path(step), dest)
        assert torch.equal(dest["t"], table) and torch.equal(dest["f"], frozen)
    assert written == [2 * table.nbytes, 32, table.nbytes, 32]
    ckpt.close()
