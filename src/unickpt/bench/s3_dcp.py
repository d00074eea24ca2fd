"""PyTorch DCP saving to and loading from S3 through fsspec/s3fs: one timed save and load.

Run by ``unickpt bench --storage s3://...`` with the interpreter of the peers environment
(s3fs pins a botocore that the main environment's boto3 does not accept); it imports only torch
and s3fs, prints one JSON line of seconds (``save_s``, ``load_s``, ``save_cpu_s``, ``load_cpu_s``)::

    .venv-peers/bin/python src/unickpt/bench/s3_dcp.py --url s3://bucket/prefix/dcp --mib 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter


def matrices(total_mib: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The benchmark's state, one matrix at a time: ``total_mib // 64`` (at least one) float32
    matrices of 4096 x 4096 (64 MiB each), drawn from seed 0."""
    g = torch.Generator().manual_seed(0)
    for i in range(max(1, total_mib // 64)):
        yield f"w{i}", torch.randn(4096, 4096, generator=g)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--endpoint", default=None)
    parser.add_argument("--mib", type=int, required=True)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args(argv)
    options: dict[str, Any] = {}
    if args.endpoint:
        options["client_kwargs"] = {"endpoint_url": args.endpoint}
    state = dict(matrices(args.mib))
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    # sync_files=False: s3fs streams cannot be fsynced; the object exists once closed
    writer = FsspecWriter(
        args.url, thread_count=args.threads, sync_files=False, overwrite=True, **options
    )
    t0, c0 = time.perf_counter(), time.process_time()
    dcp.save(state, storage_writer=writer, no_dist=True)
    t1, c1 = time.perf_counter(), time.process_time()
    dcp.load(dest, storage_reader=FsspecReader(args.url, **options), no_dist=True)
    t2, c2 = time.perf_counter(), time.process_time()
    if not all(torch.equal(dest[k], v) for k, v in state.items()):
        raise SystemExit("DCP through s3fs loaded different values than it saved")
    times = {"save_s": t1 - t0, "load_s": t2 - t1, "save_cpu_s": c1 - c0, "load_cpu_s": c2 - c1}
    print(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
