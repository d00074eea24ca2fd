from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import run_ranks

from .helpers import save_two_ranks


@pytest.fixture(scope="session")
def two_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint saved by 2 gloo processes (a row-sharded tensor, a per-rank value)."""
    path = tmp_path_factory.mktemp("two-ranks") / "c"
    path.mkdir()
    run_ranks(2, save_two_ranks, str(path))
    return path
