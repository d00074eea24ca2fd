from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from tests.distributed import preload

# No test reaches a model hub: set before anything imports huggingface_hub or datasets, which
# read these once, at import (in this process and in the fork server the ranks start from).
for _offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_offline, "1")

# One compute thread in the test process: its tensors are small, and on a loaded machine a
# second thread waiting for a busy core cost more than it gave (a test that wants more sets
# its own; the ranks have one too, in ``tests/distributed.py``).
torch.set_num_threads(1)

# Property tests draw the same examples at every run, so a run passes or fails by the code
# alone; UNICKPT_EXPLORE=1 draws new ones (to look for rare cases, not in CI).
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("UNICKPT_EXPLORE") == "1" else "fixed")

# What the ranks of some test modules import, at several CPU seconds a process: when such a
# test is collected, the fork server imports it once for every rank (``tests/distributed.py``).
RANK_IMPORTS = {
    "megatron": ("megatron.core",),
    "torchtitan": ("tests.integrations.titan_job",),
    "titan_loader": ("tests.integrations.titan_job",),
    "test_huggingface": ("transformers", "unickpt.integrations.huggingface"),
    "test_lightning": ("lightning", "unickpt.integrations.lightning"),
}

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
    for word, modules in RANK_IMPORTS.items():
        if any(word in item.nodeid for item in items):
            preload(*modules)
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
