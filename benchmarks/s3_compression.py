"""Compressed against plain saves and loads on object storage through a bandwidth-limited link.

A state of fp32 weights (N(0, 0.02), as a GPT's at initialization) and their bf16 copy is saved
to and loaded from an S3 endpoint (moto's server on loopback, started here, unless
``--endpoint`` or ``AWS_ENDPOINT_URL`` names one), with and without ``compress=True``, runs
alternating, medians of ``--repeats``. Run it in a network namespace whose loopback is limited
with ``tc`` (root can do this without touching the host's network)::

    unshare --net sh -c 'ip link set lo up && \\
        tc qdisc add dev lo root tbf rate 800mbit burst 1mb latency 100ms && \\
        python benchmarks/s3_compression.py --mib 512'

Prints a Markdown table: seconds and MB/s of the raw bytes for save (durable: every upload
completed and the commit marker written) and load, and the bytes stored.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Iterator

import torch

import unickpt
from unickpt.bench.s3 import moto_endpoint


@contextlib.contextmanager
def _endpoint(given: str | None) -> Iterator[str]:
    url = given or os.environ.get("AWS_ENDPOINT_URL")
    if url:
        yield url
        return
    with moto_endpoint() as started:
        yield started


def _state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = mib * (1 << 20) * 2 // 3 // 4  # two thirds fp32, one third its bf16 copy
    rows = n // 1024
    w = torch.randn(rows, 1024, generator=g) * 0.02
    return {"fp32": w, "bf16": w.to(torch.bfloat16)}


def _bucket(endpoint: str) -> str:
    import boto3

    name = f"unickpt-compress-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="raw size of the state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--endpoint", default=None)
    args = parser.parse_args(argv)
    state = _state(args.mib)
    raw = sum(t.nbytes for t in state.values())
    with _endpoint(args.endpoint) as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        bucket = _bucket(endpoint)
        times: dict[bool, dict[str, list[float]]] = {
            c: {"save": [], "load": []} for c in (False, True)
        }
        stored: dict[bool, int] = {}
        for r in range(args.repeats + 1):  # the first round warms up, untimed
            for compress in (False, True):
                url = f"s3://{bucket}/r{r}-{int(compress)}"
                t0 = time.perf_counter()
                report = unickpt.save(url, state, compress=compress)
                save_s = time.perf_counter() - t0
                out = {k: torch.empty_like(v) for k, v in state.items()}
                t0 = time.perf_counter()
                unickpt.load(url, out)
                load_s = time.perf_counter() - t0
                if not all(torch.equal(out[k], state[k]) for k in state):
                    raise AssertionError("a round trip changed values")
                stored[compress] = report.bytes_written
                if r:
                    times[compress]["save"].append(save_s)
                    times[compress]["load"].append(load_s)
    print(f"raw state: {raw / 1e6:,.0f} MB (fp32 N(0, 0.02) and its bf16 copy); {endpoint}")
    print("| compress | save (s) | save MB/s | load (s) | load MB/s | stored (MB) | stored/raw |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for compress in (False, True):
        save = statistics.median(times[compress]["save"])
        load = statistics.median(times[compress]["load"])
        print(
            f"| {compress} | {save:.2f} | {raw / 1e6 / save:,.0f} | {load:.2f} | "
            f"{raw / 1e6 / load:,.0f} | {stored[compress] / 1e6:,.0f} | "
            f"{stored[compress] / raw:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
