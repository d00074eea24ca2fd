"""What a load costs per tensor: many small tensors in one process, unickpt beside DCP.

Saves ``--tensors`` small float32 tensors (a few KiB each: the bytes take a few milliseconds,
so the load's time is its planning and bookkeeping per tensor) with unickpt, DCP
(``torch.distributed.checkpoint``, no process group) and ``torch.save``, then loads each into
existing tensors ``--runs`` times, alternating; medians (min-max) in milliseconds. unickpt
verifies checksums (its default); torch.load copies into the existing tensors afterwards. With
``--s3``, a further row loads unickpt's copy from an S3 endpoint (``AWS_ENDPOINT_URL``, else a
moto server started on loopback), where each read is a request.

python benchmarks/load_planning.py --tensors 600 --runs 7 [--s3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import unickpt

SHAPES = {"w1": (64, 32), "w2": (32, 64), "b": (64,), "n": (32,), "q": (32, 32), "k": (32, 32)}


def _state(tensors: int, fill: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    names = [(i, n) for i in range(tensors // len(SHAPES) + 1) for n in SHAPES][:tensors]
    return {
        f"layer{i}.{n}": torch.randn(SHAPES[n], generator=g) if fill else torch.zeros(SHAPES[n])
        for i, n in names
    }


@contextlib.contextmanager
def _bucket() -> Iterator[str]:
    """``s3://<new bucket>`` at the environment's endpoint, else at a moto server on loopback."""
    from unickpt.bench.s3 import moto_endpoint
    from unickpt.storage.s3 import S3Storage

    with contextlib.ExitStack() as stack:
        url = os.environ.get("AWS_ENDPOINT_URL") or stack.enter_context(moto_endpoint())
        os.environ["AWS_ENDPOINT_URL"] = url  # unickpt's S3 client reads it there
        bucket = f"s3://unickpt-small-{uuid.uuid4().hex[:8]}"
        storage = S3Storage(bucket)  # the client the loads will use
        storage.client.create_bucket(Bucket=storage.bucket)
        yield bucket


def measure(tensors: int, runs: int, s3: bool = False) -> dict[str, dict[str, float]]:
    src = _state(tensors, True)
    dst = _state(tensors, False)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="unickpt-load-planning-"))
        bucket = stack.enter_context(_bucket()) if s3 else None
        work = Path(tmp)
        unickpt.save(str(work / "unickpt"), src)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
            dcp.save(src, checkpoint_id=str(work / "dcp"))
        torch.save(src, work / "torch.pt")

        def torch_load() -> None:
            loaded = torch.load(work / "torch.pt", weights_only=True)
            for k, v in dst.items():
                v.copy_(loaded[k])

        def dcp_load() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(dst, checkpoint_id=str(work / "dcp"))

        systems: dict[str, Callable[[], object]] = {
            "unickpt": lambda: unickpt.load(str(work / "unickpt"), dst),
            "dcp": dcp_load,
            "torch.load": torch_load,
        }
        if bucket is not None:
            unickpt.save(f"{bucket}/unickpt", src)
            systems["unickpt (S3)"] = lambda: unickpt.load(f"{bucket}/unickpt", dst)
        times: dict[str, list[float]] = {k: [] for k in systems}
        for run in range(runs + 1):  # a first, untimed round: imports and first calls
            for name, load in systems.items():
                for v in dst.values():
                    v.zero_()
                t0 = time.perf_counter()
                load()
                seconds = time.perf_counter() - t0
                assert all(torch.equal(dst[k], src[k]) for k in src), f"{name}: values differ"
                if run:
                    times[name].append(seconds)
    return {
        k: {
            "median_ms": statistics.median(v) * 1e3,
            "min_ms": min(v) * 1e3,
            "max_ms": max(v) * 1e3,
        }
        for k, v in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tensors", type=int, default=600)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--s3", action="store_true", help="also load unickpt's copy from S3")
    args = parser.parse_args(argv)
    result = measure(args.tensors, args.runs, args.s3)
    print(json.dumps({"tensors": args.tensors, "runs": args.runs, "load": result}, indent=2))
    print(f"| load of {args.tensors} small tensors | median (min-max) |")
    print("| --- | --- |")
    for name, r in result.items():
        print(f"| {name} | {r['median_ms']:.1f} ms ({r['min_ms']:.1f}-{r['max_ms']:.1f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
