from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator

import pytest

from tests.integrity._procs import SaverServer


@pytest.fixture(scope="session")
def saver_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SaverServer]:
    """One warm saver process for the whole session; it forks the workers the tests kill."""
    server = SaverServer(tmp_path_factory.mktemp("saver") / "server.log")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """A seeded generator; the seed is printed so a failing run can be replayed."""
    seed = int(os.environ.get("INTEGRITY_SEED", time.time_ns() % 1_000_000_007))
    print(f"\n{request.node.name}: seed {seed} (replay with INTEGRITY_SEED={seed})")
    return random.Random(seed)
