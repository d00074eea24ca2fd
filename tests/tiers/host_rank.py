"""One rank of the two-host test, started inside a network namespace (see test_two_hosts)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from tests.tiers import workers


def main(argv: list[str]) -> None:
    mode, rank, world, root, shm, _host, out = argv
    r, w = int(rank), int(world)
    dist.init_process_group("gloo", rank=r, world_size=w)
    nodes = {i: "a" if i < w // 2 else "b" for i in range(w)}
    dirs = {r: shm}
    if mode == "save":
        workers.save_steps(r, w, root, dirs, nodes, [1, 2, 3], 2)
        Path(out).write_text("ready")
        time.sleep(3600)  # killed by the test, as a host failure would
    step, source = workers.restart(r, w, root, dirs, nodes, w * workers.ROWS, False)
    Path(out).write_text(json.dumps([step, source]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
