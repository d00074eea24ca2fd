"""Start a benchmark's ranks: ``world`` spawned processes joined over gloo on loopback.

``target(rank, world, *args, queue)`` runs on every rank (it initializes the process group
from ``MASTER_ADDR``/``MASTER_PORT``, which are set); what rank 0 puts on ``queue`` is returned.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_world(world: int, target: Callable[..., None], *args: Any, timeout_s: float = 3600) -> Any:
    """Run ``target`` on ``world`` spawned ranks; what rank 0 put on its queue."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    result = q.get(timeout=timeout_s)
    for p in procs:
        p.join()
    return result
