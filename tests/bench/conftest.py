from __future__ import annotations

import multiprocessing.forkserver

import pytest

from tests import distributed


@pytest.fixture
def tests_fork_server() -> None:
    """The fork server the benchmarks' ranks come from (unickpt.bench.ranks) is the process's
    one, shared with the tests' ranks: started here with the tests' imports (tests/distributed.py)
    where no test has started it yet, so a benchmark's own list does not replace theirs for the
    rest of the session."""
    distributed.context()
    multiprocessing.forkserver.ensure_running()
