"""``unickpt bench --storage s3://bucket/prefix``: save and load throughput to an S3 endpoint.

Three systems move the same bytes (float32 matrices of 64 MiB) to and from the same endpoint:

* unickpt: ``unickpt.save`` / ``unickpt.load`` of the matrices at ``<prefix>/unickpt``;
* boto3's transfer manager (the ceiling): ``upload_fileobj`` / ``download_fileobj`` of their
  bytes as one object, in parts of the size unickpt uses and with as many threads;
* PyTorch DCP through fsspec/s3fs, run with the peers environment's interpreter (s3fs pins a
  botocore the main environment's boto3 does not accept); skipped when s3fs is not there.

Every round runs each system once (save, then load), the order rotated between rounds; figures
are medians of the rounds, with the lowest and highest beside them. A first, untimed round
(``warmup``) runs every system once, so that no row carries one-time costs the next saves skip
(unickpt's first plan, the connections to the server, the server's first objects); every timed
save still takes the lock, uploads, completes and commits as any save does. Then a resharded load on
``reshard_world`` spawned ranks counts the bytes fetched against the bytes needed
(:mod:`unickpt.bench.s3_reshard`). Without an endpoint (``AWS_ENDPOINT_URL`` or ``endpoint``)
a moto server is started on loopback, and the report says so.
"""

from __future__ import annotations

import io
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import torch

import unickpt

from ..config import Config, get_config
from ..storage.s3 import S3Storage, parse_s3_url
from . import s3_dcp
from .ranks import free_port
from .s3_reshard import ReshardBytes, measure_reshard

MiB = 1 << 20
MOTO = "moto"


@dataclass(frozen=True)
class S3BenchConfig:
    """What ``unickpt bench --storage`` measures. ``endpoint``: an S3 endpoint URL; None
    takes the environment's (``AWS_ENDPOINT_URL``), or starts a moto server when it names
    none; ``"aws"``: AWS itself, whatever the environment says."""

    url: str
    endpoint: str | None = None
    mib: int = 512
    repeats: int = 3
    io_threads: int = 8
    part_mib: int = 16
    reshard_world: int = 3
    peers_python: str | None = None
    warmup: bool = True
    """Run every system once, untimed, before the timed rounds."""

    def __post_init__(self) -> None:
        parse_s3_url(self.url)
        if self.mib < 64 or self.repeats < 1 or self.io_threads < 1 or self.reshard_world < 2:
            raise ValueError(
                f"--mib {self.mib}, --repeats {self.repeats}, --io-threads {self.io_threads}, "
                f"--reshard-world {self.reshard_world}: expected at least 64, 1, 1 and 2."
            )
        if self.part_mib < 5 or self.part_mib > 5 * 1024:
            raise ValueError(f"--part-mib {self.part_mib}: S3 parts are 5 MiB to 5 GiB.")

    def unickpt_config(self) -> Config:
        part = self.part_mib * MiB
        return get_config(io_threads=self.io_threads, window_bytes=part, read_piece_bytes=part)


@dataclass(frozen=True)
class SystemTimes:
    """One system's seconds per round, wall and CPU of the client process (its threads; not
    the server's); ``message``: why it did not run."""

    name: str
    save_s: tuple[float, ...] = ()
    load_s: tuple[float, ...] = ()
    save_cpu_s: tuple[float, ...] = ()
    load_cpu_s: tuple[float, ...] = ()
    message: str = ""


@dataclass(frozen=True)
class S3Report:
    config: S3BenchConfig
    endpoint: str
    nbytes: int
    systems: tuple[SystemTimes, ...]
    reshard: tuple[ReshardBytes, ...] = field(default=())


@contextmanager
def moto_endpoint() -> Iterator[str]:
    """A moto server in its own process on a free loopback port, test credentials set in the
    environment unless some are (moto accepts any)."""
    port = free_port()
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
                    raise RuntimeError(
                        "moto_server did not start (pip install 'moto[server]')"
                    ) from None
                time.sleep(0.2)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ.setdefault(k, "bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait()


def run_s3_bench(config: S3BenchConfig, progress: Callable[[str], None] = print) -> S3Report:
    """Measure every system against the endpoint (a moto server when none is given)."""
    endpoint = config.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3")
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint == "aws":
        for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            os.environ.pop(k, None)
        return _run(config, "AWS", progress)
    if endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        return _run(config, endpoint, progress)
    progress("no S3 endpoint given: starting moto's server on loopback (figures of a local,")
    progress("single-process Python server; pass --endpoint URL to measure a real one)")
    with moto_endpoint() as url:
        os.environ["AWS_ENDPOINT_URL"] = url
        return _run(config, f"{url} ({MOTO} server started by the benchmark)", progress)


def _run(config: S3BenchConfig, endpoint: str, progress: Callable[[str], None]) -> S3Report:
    storage = S3Storage(config.url)
    if endpoint != "AWS":  # a test server: the bucket is made when missing
        with suppress(storage.client.exceptions.BucketAlreadyOwnedByYou):
            storage.client.create_bucket(Bucket=storage.bucket)
    state = dict(s3_dcp.matrices(config.mib))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    systems = _systems(config, storage, state)
    times: dict[str, list[Timing]] = {name: [] for name in systems}
    if config.warmup:
        for name, system in systems.items():
            t = system()
            progress(f"warm-up (untimed): {name}: save {t[0]:.2f} s, load {t[1]:.2f} s")
    for rnd in range(config.repeats):
        names = list(systems)
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            t = systems[name]()
            times[name].append(t)
            progress(
                f"round {rnd + 1}: {name}: save {t[0]:.2f} s (CPU {t[2]:.2f} s), "
                f"load {t[1]:.2f} s (CPU {t[3]:.2f} s)"
            )
    rows = [_times(name, runs) for name, runs in times.items()]
    if DCP not in systems:
        rows.append(SystemTimes(DCP, message=_dcp_missing(config)))
    tensors = len(state)
    del state
    progress(f"resharded loads on {config.reshard_world} spawned ranks")
    reshard = measure_reshard(
        storage.child("unickpt").location, tensors, config.reshard_world, config.unickpt_config()
    )
    return S3Report(config, endpoint, nbytes, tuple(rows), tuple(reshard))


UNICKPT, TRANSFER_MANAGER, DCP = "unickpt", "boto3 transfer manager", "DCP + fsspec/s3fs"
Timing = tuple[float, float, float, float]
"""Save and load seconds, wall then CPU."""


def _systems(
    config: S3BenchConfig, storage: S3Storage, state: dict[str, torch.Tensor]
) -> dict[str, Callable[[], Timing]]:
    """Each system's round: its :data:`Timing`, the load checked."""
    systems = {
        UNICKPT: _unickpt(config, storage.child("unickpt").location, state),
        TRANSFER_MANAGER: _transfer_manager(config, storage, state),
    }
    if _dcp_missing(config) == "":
        systems[DCP] = _dcp(config, storage.child("dcp").location)
    return systems


def _unickpt(
    config: S3BenchConfig, url: str, state: dict[str, torch.Tensor]
) -> Callable[[], Timing]:
    cfg = config.unickpt_config()
    dest = {k: torch.empty_like(v) for k, v in state.items()}

    def round_trip() -> Timing:
        save_s, save_cpu = _timed(lambda: unickpt.save(url, state, overwrite=True, config=cfg))
        load_s, load_cpu = _timed(lambda: unickpt.load(url, dest, config=cfg))
        if not all(torch.equal(dest[k], v) for k, v in state.items()):
            raise RuntimeError("unickpt loaded different values than it saved")
        return save_s, load_s, save_cpu, load_cpu

    return round_trip


def _transfer_manager(
    config: S3BenchConfig, storage: S3Storage, state: dict[str, torch.Tensor]
) -> Callable[[], Timing]:
    """The matrices' bytes as one object, in parts of unickpt's size, with as many threads
    (and the same client: connection pool, retries)."""
    from boto3.s3.transfer import TransferConfig

    payload = b"".join(t.numpy().tobytes() for t in state.values())
    part = config.part_mib * MiB
    tc = TransferConfig(
        multipart_threshold=part, multipart_chunksize=part, max_concurrency=config.io_threads
    )
    key = f"{storage.prefix}/transfer-manager/object".lstrip("/")
    client, bucket = storage.client, storage.bucket

    def round_trip() -> Timing:
        save_s, save_cpu = _timed(
            lambda: client.upload_fileobj(io.BytesIO(payload), bucket, key, Config=tc)
        )
        out = io.BytesIO()
        load_s, load_cpu = _timed(lambda: client.download_fileobj(bucket, key, out, Config=tc))
        if out.getbuffer() != payload:
            raise RuntimeError("the transfer manager downloaded different bytes")
        return save_s, load_s, save_cpu, load_cpu

    return round_trip


def _dcp(config: S3BenchConfig, url: str) -> Callable[[], Timing]:
    """DCP's save and load, timed inside a fresh process of the peers environment."""
    assert config.peers_python is not None
    command = [config.peers_python, s3_dcp.__file__, "--url", url, "--mib", str(config.mib)]
    command += ["--threads", str(config.io_threads)]
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    command += ["--endpoint", endpoint] if endpoint else []

    def round_trip() -> Timing:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"DCP through s3fs failed:\n{done.stderr[-3000:]}")
        t = json.loads(done.stdout.strip().splitlines()[-1])
        return t["save_s"], t["load_s"], t["save_cpu_s"], t["load_cpu_s"]

    return round_trip


def _dcp_missing(config: S3BenchConfig) -> str:
    """Why DCP through s3fs cannot run, or ``""``."""
    python = config.peers_python
    if python is None or not Path(python).exists():
        return "no peers environment (benchmarks/setup_peers.sh installs s3fs there)"
    probe = subprocess.run([python, "-c", "import s3fs"], capture_output=True, check=False)
    return "" if probe.returncode == 0 else f"s3fs does not import with {python}"


def _times(name: str, runs: list[Timing]) -> SystemTimes:
    save_s, load_s, save_cpu_s, load_cpu_s = (tuple(r[i] for r in runs) for i in range(4))
    return SystemTimes(name, save_s, load_s, save_cpu_s, load_cpu_s)


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all its threads) of ``fn()``."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def to_markdown(report: S3Report) -> str:
    """The report as markdown: a table of MiB/s (median, lowest-highest), ratios, bytes."""
    c, mib = report.config, report.nbytes / MiB
    warmup = " after an untimed one" if c.warmup else ""
    lines = [
        f"{mib:,.0f} MiB in {mib / 64:.0f} float32 matrices against {report.endpoint}; "
        f"{c.repeats} rounds{warmup}, systems alternating; medians (lowest-highest). unickpt "
        f"and the transfer manager: {c.io_threads} threads, parts of {c.part_mib} MiB. CPU: "
        "seconds of the client process, not the server's.",
        "",
        "| system | save MiB/s | load MiB/s | save CPU s | load CPU s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in report.systems:
        if row.message:
            lines.append(f"| {row.name} | not run: {row.message} | | | |")
        else:
            rates = f"{_rate(mib, row.save_s)} | {_rate(mib, row.load_s)}"
            cpu = (
                f"{statistics.median(row.save_cpu_s):.2f} | {statistics.median(row.load_cpu_s):.2f}"
            )
            lines.append(f"| {row.name} | {rates} | {cpu} |")
    ours, ceiling = (_row(report, n) for n in (UNICKPT, TRANSFER_MANAGER))
    lines += [
        "",
        f"unickpt / transfer manager (medians): save "
        f"{statistics.median(ceiling.save_s) / statistics.median(ours.save_s):.2f}x, load "
        f"{statistics.median(ceiling.load_s) / statistics.median(ours.load_s):.2f}x",
    ]
    for r in report.reshard:
        lines.append(
            f"resharded load onto {c.reshard_world} ranks, {r.layout} blocks: read "
            f"{r.bytes_read:,} bytes for {r.bytes_needed:,} needed ({r.ratio:.3f}x; "
            f"{r.bytes_from_peers:,} bytes taken from other ranks' reads)"
        )
    return "\n".join(lines)


def _row(report: S3Report, name: str) -> SystemTimes:
    return next(r for r in report.systems if r.name == name)


def _rate(mib: float, seconds: tuple[float, ...]) -> str:
    rates = sorted(mib / s for s in seconds)
    return f"{mib / statistics.median(seconds):,.0f} ({rates[0]:,.0f}-{rates[-1]:,.0f})"


__all__ = ["S3BenchConfig", "S3Report", "moto_endpoint", "run_s3_bench", "to_markdown"]
