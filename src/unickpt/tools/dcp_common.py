"""What the DCP exporter and importer share."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

METADATA_FILE = ".metadata"


@contextmanager
def single_process() -> Iterator[None]:
    """Silence DCP's notice that it runs without a process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
