"""Bytes fetched from S3 and load time when n nodes load one replicated state.

Each rank is a node of its own: its own UTS namespace and host name (``node-<i>``),
``UNICKPT_NODE`` set to it, ``LOCAL_WORLD_SIZE=1``; the ranks are joined over gloo on loopback.
A replicated state (``--mib`` MiB of fp32 tensors of 4 MiB) is saved once to a moto S3 server
(started here, in a process of its own), then loaded ``--repeats`` times by 1, 2, 4 and 8 nodes
(``--nodes``), every rank checking every value. Bytes fetched are the S3 backend's own count
(:class:`unickpt.storage.s3.TransferStats`, summed over the ranks), load time is from a barrier
to the last rank done (median of the repeats).

``--rate 200mbit`` limits what the S3 server sends (its port only, with ``tc``: the ranks'
gloo traffic on the same loopback stays unlimited, as a storage link shared by the nodes would
be slower than their interconnect). It changes the loopback device, so it runs only in a network
namespace of its own::

    unshare --net sh -c 'ip link set lo up && python benchmarks/replica_load.py --rate 200mbit'

Prints a Markdown table (bytes fetched / state bytes, seconds). Runs on any version of
unickpt; ``UNICKPT_SHARE_ACROSS_NODES=0`` turns the reads over the process group off.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from typing import Any

import torch
import torch.distributed as dist

from unickpt.bench import ranks
from unickpt.bench.s3 import moto_endpoint

MiB = 1 << 20
_CLONE_NEWUTS = 0x04000000
TENSOR_MIB = 4


def _state(mib: int, fill: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = max(1, mib // TENSOR_MIB)
    shape = (TENSOR_MIB * MiB // 4 // 1024, 1024)
    if fill:
        return {f"w{i}": torch.randn(shape, generator=g) for i in range(n)}
    return {f"w{i}": torch.zeros(shape) for i in range(n)}


def _own_node(rank: int) -> None:
    """Put this process in a UTS namespace of its own named ``node-<rank>`` (a node alone)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS) failed: run as root")
    socket.sethostname(f"node-{rank}")
    os.environ.update(UNICKPT_NODE=f"node-{rank}", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")


def _rank(rank: int, world: int, port: int, url: str, mib: int, repeats: int, q: Any) -> None:
    from unickpt import load
    from unickpt.storage.s3 import S3Storage

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    try:
        _own_node(rank)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        want = _state(mib, fill=True)
        runs = []
        for _ in range(repeats + 1):  # the first is a warm-up (connections, the group)
            state = _state(mib, fill=False)
            storage = S3Storage(url)
            dist.barrier()
            t0 = time.perf_counter()
            load(storage, state)
            seconds = time.perf_counter() - t0
            if not all(torch.equal(state[k], want[k]) for k in want):
                raise AssertionError("a loaded value differs from the saved one")
            runs.append((seconds, storage.stats.bytes_read))
            del state
        q.put((rank, True, runs[1:]))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _nodes(world: int, url: str, mib: int, repeats: int) -> list[tuple[float, int]]:
    """(seconds, bytes fetched by all ranks) of each repeat with ``world`` nodes."""
    ctx = ranks.context()
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    procs = [ranks.start(ctx, _rank, r, world, port, url, mib, repeats, q) for r in range(world)]
    try:
        results = [q.get(timeout=1800) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    failed = [r for r in results if not r[1]]
    if failed:
        raise RuntimeError(f"rank {failed[0][0]} failed:\n{failed[0][2]}")
    runs = [r[2] for r in sorted(results)]
    return [
        (max(rank[i][0] for rank in runs), sum(rank[i][1] for rank in runs)) for i in range(repeats)
    ]


def _own_network() -> bool:
    """Whether this process is in a network namespace of its own (a new one has only lo)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def _limit(port: int, rate: str) -> None:
    """What the server on ``port`` sends goes through a token bucket of ``rate``; the rest of
    the loopback's traffic is unlimited."""
    if not _own_network():
        raise SystemExit("--rate changes the loopback: run in a network namespace of its own")
    for cmd in (
        "tc qdisc add dev lo root handle 1: htb default 10",
        "tc class add dev lo parent 1: classid 1:10 htb rate 100gbit burst 16mb",
        f"tc class add dev lo parent 1: classid 1:30 htb rate {rate} burst 256kb",
        f"tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip sport {port} 0xffff "
        "flowid 1:30",
    ):
        subprocess.run(cmd.split(), check=True, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,2,4,8")
    parser.add_argument("--mib", type=int, default=32, help="size of the replicated state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default=None, help="e.g. 200mbit: the S3 server's send rate")
    args = parser.parse_args(argv)
    import boto3

    with moto_endpoint() as endpoint:
        port = int(endpoint.rsplit(":", 1)[1])
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        bucket = f"unickpt-replicas-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/state"
        import unickpt

        state = _state(args.mib, fill=True)
        unickpt.save(url, state)
        nbytes = sum(t.nbytes for t in state.values())
        if args.rate:
            _limit(port, args.rate)
        rows = []
        for world in [int(n) for n in args.nodes.split(",")]:
            runs = _nodes(world, url, args.mib, args.repeats)
            seconds = [s for s, _ in runs]
            fetched = [b for _, b in runs]
            rows.append((world, statistics.median(seconds), min(seconds), max(seconds), fetched))
    share = os.environ.get("UNICKPT_SHARE_ACROSS_NODES", "default")
    print(
        f"replicated state {nbytes / MiB:.0f} MiB ({len(state)} fp32 tensors); S3 (moto) "
        f"{'at ' + args.rate if args.rate else 'unlimited'}; UNICKPT_SHARE_ACROSS_NODES={share}; "
        f"medians of {args.repeats}"
    )
    print("| nodes | fetched from S3 (MiB) | fetched / state | load (s) | load vs 1 node |")
    print("| --- | --- | --- | --- | --- |")
    base = rows[0][1]
    for world, median, lo, hi, fetched in rows:
        f = statistics.median(fetched)
        print(
            f"| {world} | {f / MiB:,.1f} | {f / nbytes:.2f}x | {median:.2f} ({lo:.2f}-{hi:.2f}) "
            f"| {median / base:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
