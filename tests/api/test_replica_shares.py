"""Replicated tensors written in shares by their holders, read back into any layout, bitwise."""

from __future__ import annotations

from pathlib import Path

import torch

import unickpt
from tests.api.fresh_leaves import filled_like
from tests.api.layouts_zoo import LAYOUTS, global_tensors, local_of
from tests.distributed import run_ranks
from unickpt.engine.commit import read_checkpoint
from unickpt.storage import LocalStorage

SHARE_BYTES = 64
SAVED = ("replicated", "dt_rep_shard")  # held whole by all 4 ranks; column halves by 2 each


def _save_then_load_every_layout(rank: int, world: int, root: str) -> list[str]:
    tensors = global_tensors()
    config = unickpt.get_config(replica_share_bytes=SHARE_BYTES)
    for saved in SAVED:
        state = {n: LAYOUTS[saved](t, rank, world) for n, t in tensors.items()}
        unickpt.save(f"{root}/{saved}", state, config=config)
    failures = []
    for dest, make in LAYOUTS.items():
        made = {n: make(t, rank, world) for n, t in tensors.items()}
        for saved in SAVED:
            state = {n: filled_like(leaf, -7) for n, leaf in made.items()}
            unickpt.load(f"{root}/{saved}", state)
            for n, leaf in made.items():
                got, want = local_of(state[n]), local_of(leaf)
                if got.dtype != want.dtype or not torch.equal(got, want):
                    failures.append(f"{saved} -> {dest}: {n}")
    return failures


def test_replicas_written_in_shares_load_into_every_layout(tmp_path: Path) -> None:
    failures = run_ranks(4, _save_then_load_every_layout, str(tmp_path))
    assert failures == [[]] * 4
    tensors = global_tensors()
    _, meta = read_checkpoint(LocalStorage(tmp_path / "replicated"))
    for name, t in tensors.items():
        chunks = meta.tensors[name].chunks
        # every rank wrote a quarter of the rows (or as near as the rows allow), one share each
        assert sorted(c.file for c in chunks) == [0, 1, 2, 3], name
        rows = sorted(c.lengths[0] for c in chunks)
        assert rows[-1] - rows[0] <= 1 and sum(rows) == t.shape[0], name
        whole = {name: torch.zeros_like(t)}
        unickpt.load(tmp_path / "replicated", whole)
        assert torch.equal(whole[name], t), name
    _, meta = read_checkpoint(LocalStorage(tmp_path / "dt_rep_shard"))
    for name in tensors:
        # each column half is held by 2 ranks (one replica group each): 2 shares of it
        assert len(meta.tensors[name].chunks) == 4, name
        assert len({c.file for c in meta.tensors[name].chunks}) == 4, name
