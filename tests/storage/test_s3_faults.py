"""S3 through a proxy that answers 503 SlowDown and 500 and drops connections at random, and a
saving process killed mid-upload: saves commit through retries or fail with a clear error, and
no reader ever sees a partial checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import torch

import unickpt
from unickpt.checkpointer import step_name
from unickpt.config import get_config
from unickpt.storage.s3 import S3Storage
from unickpt.storage.s3_client import S3Settings, client_for, s3_settings

from .fault_proxy import FaultProxy, Request
from .s3_server import keys, uploads

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KiB, MiB = 1024, 1 << 20
CONFIG = get_config(
    segment_bytes=64 * KiB, window_bytes=6 * MiB, read_piece_bytes=2 * MiB, small_chunk_bytes=KiB
)
RATES = {"503": 0.05, "500": 0.03, "dropped": 0.03, "cut": 0.04}


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(3 * 1024, 1024, generator=g),  # 12 MiB: three upload parts
        "b": torch.full((100,), float(step)),
        "step": step,
    }


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(3 * 1024, 1024), "b": torch.zeros(100), "step": -1}


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    p = FaultProxy(urlparse(s3_endpoint).port or 0, RATES, seed=11)
    yield p
    p.close()


def _through(proxy: FaultProxy, url: str, settings: S3Settings) -> S3Storage:
    return S3Storage(url, settings=settings, client=client_for(settings, proxy.url))


class _Reader(threading.Thread):
    """Lists committed steps and loads the newest, over and over, until told to stop."""

    def __init__(self, root: S3Storage) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.stop = threading.Event()
        self.loads = 0
        self.partial_seen: list[str] = []
        self.errors: list[str] = []

    def run(self) -> None:
        ckpt = unickpt.Checkpointer(self.root)
        while not self.stop.is_set():
            try:
                steps = ckpt.steps()
            except unickpt.CheckpointError as e:
                self.errors.append(f"listing: {e}")
                continue
            if steps:
                self._load(ckpt, steps[-1])
            time.sleep(0.05)

    def _load(self, ckpt: unickpt.Checkpointer, step: int) -> None:
        dest = _blank()
        try:
            unickpt.load(self.root.child(step_name(step)), dest, config=CONFIG)
        except (unickpt.CheckpointNotFoundError, unickpt.CheckpointCorruptError) as e:
            if step in ckpt.steps():  # listed, still there, and not loadable: partial
                self.partial_seen.append(f"step {step}: {e}")
            return
        except unickpt.CheckpointError as e:
            self.errors.append(f"step {step}: {e}")
            return
        want = _state(step)
        if not (torch.equal(dest["w"], want["w"]) and dest["step"] == step):
            self.partial_seen.append(f"step {step}: wrong values")
        self.loads += 1


def test_saves_commit_through_faults_and_no_partial_is_seen(
    s3_endpoint: str, s3_bucket: str, proxy: FaultProxy
) -> None:
    settings = s3_settings(backoff_s=0.05)
    root = _through(proxy, f"s3://{s3_bucket}/run", settings)
    reader = _Reader(_through(proxy, f"s3://{s3_bucket}/run", settings))
    reader.start()
    committed, failed = [], []
    with unickpt.Checkpointer(root, keep_last=3, mode="sync", config=CONFIG) as ckpt:
        for step in range(8):
            try:
                ckpt.save(step, _state(step))
                committed.append(step)
            except unickpt.CheckpointError as e:
                failed.append(f"step {step}: {e}")
    reader.stop.set()
    reader.join()
    print(
        f"\nfaults: {dict(proxy.counts)}; saves committed {len(committed)} of 8; "
        f"loads by the reader {reader.loads}; partial checkpoints seen "
        f"{len(reader.partial_seen)}"
    )
    assert reader.partial_seen == []
    assert failed == [] and committed == list(range(8)), "retries carry every save through"
    assert reader.errors == [] and reader.loads > 0
    assert proxy.counts["503"] and proxy.counts["500"] and proxy.counts["dropped"]
    assert proxy.counts["cut"]
    proxy.enabled = False
    assert unickpt.Checkpointer(root).steps() == [5, 6, 7]
    dest = _blank()
    unickpt.load(root.child(step_name(7)), dest)
    assert torch.equal(dest["w"], _state(7)["w"])
    # uploads opened twice by a retried request whose answer was lost are aborted
    assert uploads(s3_endpoint, s3_bucket) == []


def test_without_retries_saves_fail_clearly_and_nothing_partial_shows(
    s3_endpoint: str, s3_bucket: str, proxy: FaultProxy
) -> None:
    no_retries = s3_settings(max_attempts=1, rounds=1)
    proxy.rates = {"503": 0.02, "500": 0.01, "dropped": 0.015, "cut": 0.015}
    url = f"s3://{s3_bucket}/fragile"
    failed, committed = [], []
    for step in range(8):
        target = _through(proxy, f"{url}/{step_name(step)}", no_retries)
        try:
            unickpt.save(target, _state(step), config=CONFIG)
            committed.append(step)
        except unickpt.CheckpointError as e:
            failed.append(str(e))
    print(
        f"\nwithout retries: faults {dict(proxy.counts)}; {len(committed)} committed, "
        f"{len(failed)} failed"
    )
    print("for example:", failed[0])
    assert failed, "a fault in 16 requests, about 20 requests a save: most saves fail"
    for message in failed:
        assert "failed" in message and "through every retry" in message, message
    proxy.enabled = False
    clean = S3Storage(url)
    assert unickpt.Checkpointer(clean).steps() == committed
    for step in committed:
        dest = _blank()
        unickpt.load(clean.child(step_name(step)), dest, config=CONFIG)
        assert torch.equal(dest["w"], _state(step)["w"])
    # a writer's lock cleans the uploads the failed saves could not abort
    with unickpt.Checkpointer(clean, mode="sync", config=CONFIG) as ckpt:
        ckpt.save(99, {"b": torch.ones(3)})
    assert uploads(s3_endpoint, s3_bucket) == []


_CHILD = """
import torch, unickpt
from unickpt.config import get_config
cfg = get_config(io_threads=1, window_bytes=5 << 20, segment_bytes=1 << 20,
                 read_piece_bytes=1 << 20)
with unickpt.Checkpointer({root!r}, mode='sync', config=cfg) as ckpt:
    ckpt.save(1, {{"w": torch.full((1000,), 1.0), "step": 1}})
    print("saved 1", flush=True)
    ckpt.save(2, {{"w": torch.ones(40 << 20), "step": 2}})  # 160 MiB, 32 parts, one at a time
"""


def test_a_save_killed_mid_upload(s3_endpoint: str, s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/killed"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(root=root)],
        stdout=subprocess.PIPE,
        env=os.environ.copy(),
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"saved 1"
        deadline = time.monotonic() + 120
        client = client_for(s3_settings())
        while time.monotonic() < deadline and child.poll() is None:
            found = client.list_multipart_uploads(Bucket=s3_bucket, Prefix="killed/")
            ups = found.get("Uploads", [])
            if (
                ups
                and len(
                    client.list_parts(
                        Bucket=s3_bucket, Key=ups[0]["Key"], UploadId=ups[0]["UploadId"]
                    ).get("Parts", [])
                )
                >= 2
            ):
                break
            time.sleep(0.02)
        assert child.poll() is None, "the child finished before it could be killed"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    # the killed save is invisible; the previous checkpoint loads
    assert uploads(s3_endpoint, s3_bucket, "killed/") != []
    ckpt = unickpt.Checkpointer(root)
    assert ckpt.steps() == [1]
    dest: dict[str, Any] = {"w": torch.zeros(1000), "step": -1}
    assert ckpt.load_latest(dest) == 1 and torch.equal(dest["w"], torch.full((1000,), 1.0))
    # the next writer takes over the dead writer's lock at once (its process on this host is
    # gone), aborts its uploads and removes its folder
    with unickpt.Checkpointer(root, mode="sync") as ckpt:
        ckpt.save(3, {"w": torch.full((1000,), 3.0), "step": 3})
        assert ckpt.steps() == [1, 3]
    assert uploads(s3_endpoint, s3_bucket, "killed/") == []
    assert S3Storage(root).list_names() == ["ROOT_ID", "step-000000001", "step-000000003"]


def _fail_once(point: str) -> Callable[[Request], str | None]:
    """A proxy rule: the request at ``point`` of a multipart upload fails; at ``part``, the
    abort that follows fails once too (a cleanup must not give up where retries are off)."""
    failed: set[str] = set()

    def rule(r: Request) -> str | None:
        upload = "uploadId=" in r.target
        step = {
            ("POST", False): "start" if r.target.endswith("?uploads") else "",
            ("PUT", True): "part" if "partNumber=2" in r.target else "",
            ("POST", True): "complete",
            ("DELETE", True): "abort",
        }.get((r.method, upload), "")
        wanted = step == point or (point == "part" and step == "abort")
        if not wanted or step in failed:
            return "ok"
        failed.add(step)
        return "500" if step in ("part", "abort") else "cut"

    return rule


@pytest.mark.parametrize(
    ("point", "message"),
    [
        ("start", "starting the upload of"),
        ("part", "uploading part 2 of"),
        ("complete", "completing the upload of"),
    ],
)
def test_a_save_failing_without_retries_leaves_no_upload_open(
    s3_endpoint: str, s3_bucket: str, point: str, message: str
) -> None:
    """The start's answer lost (the upload opened), a part refused (and the abort after it
    refused once), the completion's answer lost (the object landed): the save fails and
    neither an open upload nor the data object is left."""
    proxy = FaultProxy(urlparse(s3_endpoint).port or 0, {}, rule=_fail_once(point))
    try:
        no_retries = s3_settings(max_attempts=1, rounds=1, backoff_s=0.05)
        target = _through(proxy, f"s3://{s3_bucket}/once", no_retries)
        with pytest.raises(unickpt.CheckpointError, match=message) as failure:
            unickpt.save(target, _state(1), config=CONFIG)
    finally:
        proxy.close()
    assert "an earlier committed checkpoint, if any, is untouched" in str(failure.value)
    assert proxy.counts["500"] + proxy.counts["cut"] == (2 if point == "part" else 1)
    assert uploads(s3_endpoint, s3_bucket) == []
    assert [k for k in keys(s3_endpoint, s3_bucket) if "/data-" in k] == []
