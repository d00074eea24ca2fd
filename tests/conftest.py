from __future__ import annotations

import pytest
import torch

from tests.distributed import preload

# Long multi-process and soak tests (a minute or more each on 2 cores): run in CI and with
# UNICKPT_ALL_TESTS=1 (scripts/check), left out of a developer's quick run. Whole modules are
# named here; single tests are marked ``@pytest.mark.slow`` where they stand.
SLOW_MODULES = (
    "tests/api/test_fsdp2_resume.py",
    "tests/api/test_random_layouts.py",
    "tests/api/test_reshard.py",
    "tests/bench/test_memory_tier.py",
    "tests/bench/test_s3_bench.py",
    "tests/data/test_resume.py",
    "tests/integrity/test_crash.py",
    "tests/storage/test_s3_reshard.py",
    "tests/tiers/test_restart.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("megatron" in item.nodeid for item in items):
        # Megatron-Core's import takes about 5 CPU seconds; its tests start many ranks
        preload("megatron.core")
    slow = pytest.mark.slow
    for item in items:
        if item.nodeid.split("::", 1)[0] in SLOW_MODULES:
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
