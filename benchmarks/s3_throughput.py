"""Save and load throughput to an S3 endpoint, beside boto3's transfer manager moving the same
bytes (the ceiling), and the bytes a resharded load reads against the bytes it needs.

python benchmarks/s3_throughput.py                        # starts moto_server on loopback
python benchmarks/s3_throughput.py --mib 1024 --repeat 5 --io-threads 8
python benchmarks/s3_throughput.py --endpoint http://127.0.0.1:9000 --bucket bench

Credentials and endpoint come from the environment (AWS_*) unless ``--endpoint`` is given;
the bucket is created when missing. Medians of ``--repeat`` runs. PyTorch DCP through
fsspec/s3fs is measured too when s3fs imports.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch

import unickpt
from unickpt.config import get_config
from unickpt.storage.s3 import S3Storage
from unickpt.storage.s3_client import client_for, s3_settings

MiB = 1 << 20


@contextmanager
def moto_endpoint() -> Iterator[str]:
    """A moto server in its own process on a free loopback port (test credentials set)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.2)
        for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait()


def median_s(fn: Callable[[], object], repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def build_state(total_mib: int) -> dict[str, torch.Tensor]:
    """Matrices of 64 MiB (float32, 4096 x 4096) adding up to ``total_mib``."""
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(4096, 4096, generator=g) for i in range(max(1, total_mib // 64))}


def transfer_manager(client: Any, bucket: str, payload: bytes, args: argparse.Namespace) -> Any:
    """Upload and download functions of boto3's transfer manager for ``payload``."""
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(
        multipart_chunksize=args.tm_chunk_mib * MiB, max_concurrency=args.tm_concurrency
    )

    def upload() -> None:
        client.upload_fileobj(io.BytesIO(payload), bucket, "tm/object", Config=config)

    def download() -> None:
        out = io.BytesIO()
        client.download_fileobj(bucket, "tm/object", out, Config=config)
        assert out.getbuffer().nbytes == len(payload)

    return upload, download


def reshard_ratio(url: str, state: dict[str, torch.Tensor], ranks: int, dim: int) -> float:
    """Bytes read / bytes needed for loading ``state`` split in ``ranks`` blocks along ``dim``."""
    storage = S3Storage(url)
    needed = 0
    for r in range(ranks):
        part = {}
        for k, t in state.items():
            n = t.shape[dim]
            lo, hi = n * r // ranks, n * (r + 1) // ranks
            offsets = (lo, 0) if dim == 0 else (0, lo)
            block = t.narrow(dim, lo, hi - lo)
            part[k] = unickpt.ShardedTensor(torch.empty_like(block), tuple(t.shape), offsets)
            needed += block.numel() * block.element_size()
        unickpt.load(storage, part)
        assert all(
            torch.equal(part[k].local, state[k].narrow(dim, *_span(part[k], dim))) for k in state
        )
    return storage.stats.bytes_read / needed


def _span(st: unickpt.ShardedTensor, dim: int) -> tuple[int, int]:
    return st.offsets[dim], st.local.shape[dim]


def dcp_functions(bucket: str, state: dict[str, torch.Tensor]) -> Any:
    """DCP's save and load through fsspec/s3fs, or None when s3fs does not import."""
    try:
        import s3fs  # noqa: F401
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FsspecReader, FsspecWriter
    except ImportError:
        return None
    path = f"s3://{bucket}/dcp"
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    return (
        lambda: dcp.save(state, storage_writer=FsspecWriter(path, overwrite=True)),
        lambda: dcp.load(dest, storage_reader=FsspecReader(path)),
    )


def run(args: argparse.Namespace) -> None:
    client = client_for(s3_settings(), args.endpoint)
    with suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=args.bucket)
    state = build_state(args.mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    payload = b"".join(t.numpy().tobytes() for t in state.values())
    config = get_config(io_threads=args.io_threads, window_bytes=args.window_mib * MiB)
    url = f"s3://{args.bucket}/unickpt"
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    rows: list[tuple[str, float, float]] = []

    def save() -> None:
        unickpt.save(url, state, overwrite=True, config=config)

    def load() -> None:
        unickpt.load(url, dest, config=config)

    upload, download = transfer_manager(client, args.bucket, payload, args)
    rows.append(("unickpt", median_s(save, args.repeat), median_s(load, args.repeat)))
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    rows.append(
        ("boto3 transfer manager", median_s(upload, args.repeat), median_s(download, args.repeat))
    )
    dcp_fns = dcp_functions(args.bucket, state)
    if dcp_fns is not None:
        rows.append(
            (
                "DCP + fsspec/s3fs",
                median_s(dcp_fns[0], args.repeat),
                median_s(dcp_fns[1], args.repeat),
            )
        )
    print(
        f"{nbytes / MiB:,.0f} MiB in {len(state)} tensors, {args.repeat} runs (medians), "
        f"unickpt io_threads={args.io_threads} window={args.window_mib} MiB, transfer "
        f"manager {args.tm_concurrency} threads x {args.tm_chunk_mib} MiB, "
        f"{'moto_server' if args.started else args.endpoint}"
    )
    print("| system | save MiB/s | load MiB/s |\n| --- | --- | --- |")
    for name, save_s, load_s in rows:
        print(f"| {name} | {nbytes / MiB / save_s:,.0f} | {nbytes / MiB / load_s:,.0f} |")
    if dcp_fns is None:
        print("(DCP through fsspec/s3fs: s3fs is not installed)")
    ceiling = rows[1]
    print(
        f"unickpt / transfer manager: save {ceiling[1] / rows[0][1]:.2f}x, "
        f"load {ceiling[2] / rows[0][2]:.2f}x"
    )
    rows_ratio = reshard_ratio(url, state, 3, 0)
    cols_ratio = reshard_ratio(url, state, 3, 1)
    print(
        f"resharded load onto 3 ranks, bytes read / bytes needed: row blocks "
        f"{rows_ratio:.3f}x, column blocks {cols_ratio:.3f}x"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--endpoint", help="S3 endpoint URL (default: start moto_server)")
    parser.add_argument("--bucket", default="unickpt-bench")
    parser.add_argument("--mib", type=int, default=512, help="bytes to move, in MiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--io-threads", type=int, default=8, help="unickpt's I/O threads")
    parser.add_argument("--window-mib", type=int, default=16, help="unickpt's part size")
    parser.add_argument("--tm-concurrency", type=int, default=8)
    parser.add_argument("--tm-chunk-mib", type=int, default=16)
    args = parser.parse_args(argv)
    args.started = args.endpoint is None
    if args.endpoint is None:
        with moto_endpoint() as endpoint:
            os.environ["AWS_ENDPOINT_URL"] = endpoint
            args.endpoint = endpoint
            run(args)
    else:
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
