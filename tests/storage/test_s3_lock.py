"""The S3 writer lock against a real S3 server (moto, on loopback): a holder killed with
SIGKILL, restarts of the same run on this host and on another (a UTS namespace of its own), a
live holder of the same run, a holder whose lock was taken, a server that ignores
``If-None-Match``, ETags that change on every write."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

import pytest

import unickpt
from tests.distributed import run_ranks
from tests.root.takeover import check_the_lock_was_taken, saves_after_the_lock_is_taken
from unickpt.storage.holder import RUN_ID_VARIABLES, run_id
from unickpt.storage.s3 import S3Storage
from unickpt.storage.s3_client import client_for, s3_settings

from .fault_proxy import FaultProxy, Request
from .s3_server import keys, raw_client

_HOLDER = """
import sys
from unickpt.storage.s3 import S3Storage
release = S3Storage(sys.argv[1]).acquire_lock()
print("locked", flush=True)
sys.stdin.readline()  # killed here, holding the lock
"""

_OTHER = {
    "holder": "pid 4242 on node-9",
    "host": "node-9",
    "pid": 4242,
    "run_id": "UNICKPT_RUN_ID=other",
    "since": "2026-01-01T00:00:00+00:00",
    "token": "not-yours",
}


@pytest.fixture(autouse=True)
def _no_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in (*RUN_ID_VARIABLES, "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(variable, raising=False)


def _other_hosts() -> bool:
    """Whether this process may start others in a UTS namespace of their own (as root)."""
    try:
        done = subprocess.run(["unshare", "--uts", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


needs_other_hosts = pytest.mark.skipif(
    not _other_hosts(), reason="needs unshare --uts (root) for a holder on another host"
)


@contextmanager
def _holder(
    url: str, host: str = "", run: str | None = None, refresh_s: float | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A process holding the lock of ``url`` until killed: on another host (a UTS namespace
    of its own whose host name is ``host``) when given, as run ``run``, refreshing it every
    ``refresh_s``."""
    env = {**os.environ, **({"UNICKPT_RUN_ID": run} if run else {})}
    if refresh_s is not None:
        env["UNICKPT_S3_LOCK_REFRESH_S"] = str(refresh_s)
    elsewhere = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host]
    child = subprocess.Popen(
        [*(elsewhere if host else []), sys.executable, "-c", _HOLDER, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"locked"
        yield child
    finally:
        child.kill()
        child.wait()


def _kill(child: subprocess.Popen[bytes]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL


def _lock_body(endpoint: str, bucket: str, key: str) -> dict[str, object]:
    raw = raw_client(endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()
    info: dict[str, object] = json.loads(raw)
    return info


def test_the_run_id_comes_from_unickpt_torchrun_or_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_id() is None
    monkeypatch.setenv("SLURM_JOB_ID", "7781")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # the same job requeued: the same run
    assert run_id() == "SLURM_JOB_ID=7781"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default --rdzv-id: no id
    assert run_id() == "SLURM_JOB_ID=7781"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "gpt-7b")
    assert run_id() == "TORCHELASTIC_RUN_ID=gpt-7b"
    monkeypatch.setenv("UNICKPT_RUN_ID", "mine")
    assert run_id() == "UNICKPT_RUN_ID=mine"


@needs_other_hosts
def test_a_restart_of_the_same_run_on_another_host_waits_for_the_heartbeat_to_stop(
    s3_endpoint: str,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The holder ran on another node and was killed: its lock is fresh (600 s to go stale);
    another run is refused, naming holder, host, run id and age; the same run takes it once
    the lock has gone three of its holder's refresh periods (1 s) without a refresh, and
    says that it waits."""
    url = f"s3://{s3_bucket}/run"
    refused = (
        r"s3://.*/run is being written by pid \d+ on node-7 \(host node-7, run id "
        r"UNICKPT_RUN_ID=run-a; since .*, lock refreshed \d+ s ago\); this writer is pid "
        r"\d+ on .* \(run id UNICKPT_RUN_ID=run-b\)\. Two jobs must not save into the same "
        r"place: stop the other job or choose another path\. If that job is gone and this is "
        r"its restart, give both the same run id"
    )
    caplog.set_level(logging.WARNING, logger="unickpt.storage.s3_lock")
    with _holder(url, host="node-7", run="run-a", refresh_s=1.0) as child:
        assert _lock_body(s3_endpoint, s3_bucket, "run/LOCK")["host"] == "node-7"
        monkeypatch.setenv("UNICKPT_RUN_ID", "run-b")
        with pytest.raises(unickpt.CheckpointLockedError, match=refused):
            S3Storage(url).acquire_lock()
        _kill(child)
        with pytest.raises(unickpt.CheckpointLockedError, match=refused):
            S3Storage(url).acquire_lock()
        assert caplog.records == []
        monkeypatch.setenv("UNICKPT_RUN_ID", "run-a")
        release = S3Storage(url).acquire_lock()
        taken = _lock_body(s3_endpoint, s3_bucket, "run/LOCK")
        assert taken["pid"] == os.getpid() and taken["run_id"] == "UNICKPT_RUN_ID=run-a"
        release()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert re.fullmatch(
        r"s3://.*/run/LOCK is held by pid \d+ on node-7 of this run \(UNICKPT_RUN_ID=run-a\) "
        r"on host node-7, refreshed \d+ s ago: waiting until it has gone 3 s without a "
        r"refresh before taking it over .*",
        said[0],
    ), said[0]
    assert re.fullmatch(
        r"s3://.*/run/LOCK: taking over the lock of pid \d+ on node-7: a restart of its run "
        r"\(UNICKPT_RUN_ID=run-a\): its heartbeat from node-7 stopped for 3 s",
        said[1],
    ), said[1]
    assert keys(s3_endpoint, s3_bucket) == []


@needs_other_hosts
def test_a_live_holder_of_the_same_run_on_another_host_keeps_its_lock(
    s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two job steps of one SLURM allocation (one SLURM_JOB_ID) on two hosts: the second
    waits, sees the first's heartbeat go on, and is refused; the lock stays the first's."""
    url = f"s3://{s3_bucket}/steps"
    monkeypatch.setenv("SLURM_JOB_ID", "7781")
    with _holder(url, host="node-3", refresh_s=2.0) as child:
        held = _lock_body(s3_endpoint, s3_bucket, "steps/LOCK")
        assert held["run_id"] == "SLURM_JOB_ID=7781"
        with pytest.raises(
            unickpt.CheckpointLockedError,
            match=rf"s3://.*/steps is being written by pid {child.pid} on node-3 \(host "
            r"node-3, run id SLURM_JOB_ID=7781; since .*\), a writer of this same run on "
            r"another host, and alive: it refreshed the lock while this writer \(pid \d+ on "
            r".*\) waited \d+ s for its heartbeat to stop\. Two writers must not save into "
            r"one place, even of one run \(the job steps of one SLURM allocation share "
            r"SLURM_JOB_ID\)",
        ):
            S3Storage(url).acquire_lock()
        assert _lock_body(s3_endpoint, s3_bucket, "steps/LOCK")["token"] == held["token"]
        assert held["refresh_s"] == 2.0  # the period the waiting writer went by


def test_a_holder_killed_on_this_host_is_taken_over_at_once(
    s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{s3_bucket}/here"
    with _holder(url, run="run-a") as child:
        # alive: refused, even for its own run (a second writer of the run in the same place)
        for run in (None, "run-a"):
            if run is not None:
                monkeypatch.setenv("UNICKPT_RUN_ID", run)
            with pytest.raises(unickpt.CheckpointLockedError, match=rf"pid {child.pid} on"):
                S3Storage(url).acquire_lock()
        monkeypatch.delenv("UNICKPT_RUN_ID")
        _kill(child)
        release = S3Storage(url).acquire_lock()  # no run id: its process is gone
        assert _lock_body(s3_endpoint, s3_bucket, "here/LOCK")["pid"] == os.getpid()
        release()
    assert keys(s3_endpoint, s3_bucket) == []


def _is_lock_put(r: Request) -> bool:
    return r.method == "PUT" and r.target.split("?")[0].endswith("/LOCK")


@contextmanager
def _ignoring_if_none_match(
    s3_endpoint: str, after: object = None
) -> Iterator[tuple[FaultProxy, S3Storage]]:
    def rule(r: Request) -> str | None:
        if _is_lock_put(r):
            r.drop_header("If-None-Match")
        return "ok"

    port = urlparse(s3_endpoint).port or 0
    proxy = FaultProxy(port, {}, rule=rule, after=after)  # type: ignore[arg-type]
    settings = s3_settings()
    try:
        yield proxy, S3Storage("s3://x", settings=settings, client=client_for(settings, proxy.url))
    finally:
        proxy.close()


def test_a_server_ignoring_if_none_match_gives_no_second_holder(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """A live lock is read before any PUT, so it is never written over."""
    url = f"s3://{s3_bucket}/live"
    release = S3Storage(url).acquire_lock()
    mine = _lock_body(s3_endpoint, s3_bucket, "live/LOCK")
    with (
        _ignoring_if_none_match(s3_endpoint) as (_, through),
        pytest.raises(unickpt.CheckpointLockedError, match=r"being written by pid \d+"),
    ):
        S3Storage(url, settings=through.settings, client=through.client).acquire_lock()
    assert _lock_body(s3_endpoint, s3_bucket, "live/LOCK") == mine
    release()
    assert keys(s3_endpoint, s3_bucket) == []


def test_a_writer_whose_lock_was_overwritten_is_refused(s3_endpoint: str, s3_bucket: str) -> None:
    """Two writers race for a free lock on a server that ignores If-None-Match: the other's
    PUT lands right after this one's; the read-back finds the other's token and refuses."""
    done = threading.Event()

    def other_writes_too(r: Request) -> None:
        if _is_lock_put(r) and not done.is_set():
            done.set()
            body = json.dumps(_OTHER).encode()
            raw_client(s3_endpoint).put_object(Bucket=s3_bucket, Key="race/LOCK", Body=body)

    with _ignoring_if_none_match(s3_endpoint, other_writes_too) as (_, through):
        url = f"s3://{s3_bucket}/race"
        racing = S3Storage(url, settings=through.settings, client=through.client)
        with pytest.raises(
            unickpt.CheckpointLockedError,
            match=r"did not hold this writer's token when read back right after it was written: "
            r"pid 4242 on node-9 \(run id UNICKPT_RUN_ID=other\) wrote it over\. The server may "
            r"ignore conditional writes \(If-None-Match\)",
        ):
            racing.acquire_lock()
    assert done.is_set()
    assert _lock_body(s3_endpoint, s3_bucket, "race/LOCK") == _OTHER, "the winner's, left alone"


def test_refreshes_and_the_release_follow_the_etag_as_it_changes(
    s3_endpoint: str, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store whose ETag changes on every write of the same content (S3's under SSE-KMS;
    here a proxy that pads each lock PUT): every refresh is conditional on the ETag the last
    one got, and the release deletes the lock; a lock taken over is left to its new holder."""
    puts = []

    def new_etag_each_put(r: Request) -> str | None:
        if _is_lock_put(r):
            puts.append(1)
            r.body += b" " * len(puts)  # JSON allows trailing blanks; the MD5 differs
            for name in [h for h in r.headers if h.lower().startswith("x-amz-checksum")]:
                r.drop_header(name)
            r.headers["Content-Length"] = str(len(r.body))
        return "ok"

    proxy = FaultProxy(urlparse(s3_endpoint).port or 0, {}, rule=new_etag_each_put)
    settings = s3_settings(lock_stale_s=1.0)  # a refresh every 0.25 s
    store = S3Storage(
        f"s3://{s3_bucket}/beat", settings=settings, client=client_for(settings, proxy.url)
    )
    caplog.set_level(logging.WARNING, logger="unickpt.storage.s3_lock")
    try:
        release = store.acquire_lock()
        deadline = time.monotonic() + 60
        while len(puts) < 5 and not caplog.records and time.monotonic() < deadline:
            time.sleep(0.05)
        release()
        assert [r.getMessage() for r in caplog.records] == []
        assert len(puts) >= 5 and keys(s3_endpoint, s3_bucket) == []
        # taken over meanwhile (by a writer that found it stale): the release leaves it
        release = store.acquire_lock()
        body = json.dumps(_OTHER).encode()
        raw_client(s3_endpoint).put_object(Bucket=s3_bucket, Key="beat/LOCK", Body=body)
        release()
        assert _lock_body(s3_endpoint, s3_bucket, "beat/LOCK") == _OTHER
    finally:
        proxy.close()


def test_a_holder_whose_lock_was_taken_stops_saving_on_every_rank(s3_bucket: str) -> None:
    """A Checkpointer on two ranks holds the lock; another writer (on another host) takes it
    over: the holder's next saves raise on every rank, nothing is written or deleted, and its
    close leaves the other's lock alone."""
    root = f"s3://{s3_bucket}/run"
    results = run_ranks(2, saves_after_the_lock_is_taken, root, timeout_s=240)
    taken = (
        rf"s3://{s3_bucket}/run/LOCK: this writer \(pid \d+ on .*, run id none\) no longer "
        r"holds the lock: pid 4242 on node-9 took it over \(host node-9, run id "
        r"SLURM_JOB_ID=7781, since 2026-01-01T00:00:00\+00:00\)"
    )
    check_the_lock_was_taken(results, root, taken)
    assert (
        json.loads(
            raw_client(os.environ["AWS_ENDPOINT_URL"])
            .get_object(Bucket=s3_bucket, Key="run/LOCK")["Body"]
            .read()
        )["token"]
        == "not-yours"
    )
