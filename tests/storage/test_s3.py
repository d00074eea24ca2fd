"""s3:// against a real S3 server (moto, over HTTP on loopback): save, async_save, load,
resharded reads of byte ranges, checksums, the Checkpointer, the lock, the command line."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from unickpt.cli.main import main
from unickpt.config import get_config
from unickpt.storage import Storage, open_storage
from unickpt.storage.s3 import S3Storage
from unickpt.storage.s3_client import s3_settings
from unickpt.tools import verify_checkpoint

from .s3_server import keys, raw_client, uploads
from .scenarios import async_and_refused_saves, checkpointer_and_command_line

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KiB, MiB = 1024, 1 << 20
CONFIG = get_config(
    segment_bytes=64 * KiB, window_bytes=6 * MiB, read_piece_bytes=MiB, small_chunk_bytes=KiB
)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * 1024, 1024, generator=g),  # 12 MiB: a multipart upload
        "small": {f"s{i}": torch.full((i + 1,), float(seed + i)) for i in range(20)},
        "step": seed,
    }


def _blank() -> dict[str, Any]:
    state = _state(0)
    state["big"].fill_(-1)
    for t in state["small"].values():
        t.fill_(-1)
    state["step"] = -1
    return state


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["big"], b["big"])
    assert all(torch.equal(a["small"][k], b["small"][k]) for k in a["small"])
    assert a["step"] == b["step"]


def test_save_load_reshard_and_damage(s3_endpoint: str, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/one/ckpt"
    state = _state(5)
    unickpt.save(url, state, config=CONFIG)
    names = keys(s3_endpoint, s3_bucket, "one/ckpt/")
    assert "one/ckpt/COMMIT" in names and uploads(s3_endpoint, s3_bucket) == []
    data = next(k for k in names if "/data-" in k)
    head = raw_client(s3_endpoint).head_object(Bucket=s3_bucket, Key=data)
    assert head["ETag"].endswith('-3"'), "12 MiB in 6 MiB windows: three uploaded parts"
    dest = _blank()
    unickpt.load(url, dest, config=CONFIG)
    _assert_same(dest, state)
    # a resharding read: a block of "big" costs its byte ranges only (whole checksum segments)
    storage = S3Storage(url)
    part = unickpt.ShardedTensor(torch.zeros(1024, 256), (3 * 1024, 1024), (1024, 512))
    report = unickpt.load(storage, {"big": part}, strict=False, config=CONFIG)
    assert torch.equal(part.local, state["big"][1024:2048, 512:768])
    assert report.bytes_wanted == 1024 * 256 * 4
    assert storage.stats.bytes_read <= 4 * MiB + 64 * KiB, "rows of 4 KiB in 64 KiB segments"
    assert verify_checkpoint(url).ok
    # a flipped byte on the server is found by the checksums
    client = raw_client(s3_endpoint)
    raw = bytearray(client.get_object(Bucket=s3_bucket, Key=data)["Body"].read())
    raw[5 * MiB + 3] ^= 0x10
    client.put_object(Bucket=s3_bucket, Key=data, Body=bytes(raw))
    report_v = verify_checkpoint(url)
    assert not report_v.ok and "checksum mismatch" in report_v.damage[0].message
    with pytest.raises(unickpt.CheckpointCorruptError, match="checksum mismatch"):
        unickpt.load(url, _blank(), config=CONFIG)
    # a data file cut short is truncated, not garbage
    client.put_object(Bucket=s3_bucket, Key=data, Body=bytes(raw[: 4 * MiB]))
    with pytest.raises(unickpt.CheckpointCorruptError, match="truncated"):
        unickpt.load(url, _blank(), config=CONFIG)


class _SmallPartsS3(S3Storage):
    """S3 with a part cap of 8 MiB instead of 5 GiB, to cut chunks as 5 GiB would."""

    max_part_bytes = 8 * MiB


def test_a_chunk_above_the_part_cap_is_cut_also_when_not_contiguous(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """16 MiB of a transposed (non-contiguous) matrix: one PUT without a cap; under a cap of
    8 MiB, pieces of at most 6 MiB (the cap less a quarter of it, for uncut chunks), each
    copied on its own; the values load back bitwise."""
    t = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(3)).t()
    assert not t.is_contiguous()
    for name, storage, etag_end in (
        ("whole", S3Storage(f"s3://{s3_bucket}/cap/whole"), '"'),
        ("cut", _SmallPartsS3(f"s3://{s3_bucket}/cap/cut"), '-3"'),
    ):
        unickpt.save(storage, {"t": t}, config=CONFIG)
        data = next(k for k in keys(s3_endpoint, s3_bucket, f"cap/{name}/") if "/data-" in k)
        head = raw_client(s3_endpoint).head_object(Bucket=s3_bucket, Key=data)
        assert head["ETag"].endswith(etag_end) and head["ContentLength"] >= 16 * MiB
        dest = {"t": torch.zeros(4096, 1024)}
        unickpt.load(storage, dest, config=CONFIG)
        assert torch.equal(dest["t"], t)


class _LostAnswers(S3Storage):
    """S3 whose answers to the marker's PUT and to deletes are lost after the server acted
    (as a connection cut after the request reached the server)."""

    def write_atomic(self, name: str, data: bytes) -> None:
        super().write_atomic(name, data)
        if name == "COMMIT":
            raise unickpt.CheckpointError(f"writing {name} failed: the answer was lost")

    def remove_many(self, names: Sequence[str]) -> None:
        super().remove_many(names)
        raise unickpt.CheckpointError(f"deleting {names[0]} failed: the answer was lost")


def test_a_save_whose_marker_landed_is_committed(
    s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The marker's answer lost: the save reads it back and counts as committed; a cleanup
    that fails after the marker only warns (the next save removes what is left)."""
    storage = _LostAnswers(f"s3://{s3_bucket}/lost")
    unickpt.save(storage, _state(1), config=CONFIG)
    unickpt.save(storage, _state(2), config=CONFIG, overwrite=True)
    assert "the checkpoint is committed, the next save removes the rest" in caplog.text
    dest = _blank()
    unickpt.load(f"s3://{s3_bucket}/lost", dest, config=CONFIG)
    _assert_same(dest, _state(2))


def _checksums(endpoint: str, bucket: str, prefix: str) -> dict[str, str]:
    """The checksum type and members S3 keeps for the data file under ``prefix``."""
    client = raw_client(endpoint)
    data = next(k for k in keys(endpoint, bucket, prefix) if "/data-" in k)
    head = client.head_object(Bucket=bucket, Key=data, ChecksumMode="ENABLED")
    return {k: str(v) for k, v in head.items() if k.startswith("Checksum")}


def test_uploads_declare_the_checksum_their_parts_carry(s3_endpoint: str, s3_bucket: str) -> None:
    """A multipart upload declares CRC32 and completes with every part's CRC32 (the server
    keeps a checksum combined from the parts' and does not hash the whole object again);
    with checksums only where required, the upload declares none."""
    state = _state(3)
    unickpt.save(f"s3://{s3_bucket}/crc", state, config=CONFIG)
    assert set(_checksums(s3_endpoint, s3_bucket, "crc/")) == {"ChecksumCRC32"}
    # the client of a server without checksums: nothing declared, nothing asked of parts
    client = raw_client(s3_endpoint, request_checksum_calculation="when_required")
    storage = S3Storage(f"s3://{s3_bucket}/plain", client=client)
    assert storage.checksum_algorithm() is None
    unickpt.save(storage, state, config=CONFIG)
    assert _checksums(s3_endpoint, s3_bucket, "plain/") == {}
    for url in (f"s3://{s3_bucket}/crc", f"s3://{s3_bucket}/plain"):
        dest = _blank()
        unickpt.load(url, dest, config=CONFIG)
        _assert_same(dest, state)


def test_a_save_deletes_the_files_it_replaces_in_one_request(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """Saving over a checkpoint removes the earlier save's data, index and metadata with one
    DeleteObjects, after the new marker; they are gone and the new checkpoint loads."""
    client = raw_client(s3_endpoint)
    sent: list[str] = []
    client.meta.events.register(
        "before-call.s3", lambda model, **_: sent.append(model.name), unique_id="count"
    )
    storage = S3Storage(f"s3://{s3_bucket}/over", client=client)
    unickpt.save(storage, _state(1), config=CONFIG)
    first = set(keys(s3_endpoint, s3_bucket, "over/"))
    sent.clear()
    unickpt.save(storage, _state(2), config=CONFIG, overwrite=True)
    deletes = [op for op in sent if op.startswith("DeleteObject")]
    assert deletes == ["DeleteObjects", "DeleteObject"], "the earlier files, then the lock"
    last_put = max(i for i, op in enumerate(sent) if op == "PutObject")  # the marker
    assert last_put < sent.index("DeleteObjects")
    now = set(keys(s3_endpoint, s3_bucket, "over/"))
    assert first & now == {"over/COMMIT"} and len(now) == 4, "COMMIT, data, index, metadata"
    dest = _blank()
    unickpt.load(f"s3://{s3_bucket}/over", dest, config=CONFIG)
    _assert_same(dest, _state(2))


class _IndexRefused(S3Storage):
    """S3 that refuses the index PUT, which is sent while the data file's upload completes."""

    def write_atomic(self, name: str, data: bytes) -> None:
        if name.startswith("index-"):
            raise unickpt.CheckpointError(f"writing {name} failed: AccessDenied (HTTP 403)")
        super().write_atomic(name, data)


def test_a_refused_index_fails_the_save_and_removes_its_data(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """The index is written alongside the completion of the data file's upload: when it
    fails, the save fails with its error and the data file (completed or not) is removed."""
    unickpt.save(f"s3://{s3_bucket}/idx", _state(1), config=CONFIG)
    before = keys(s3_endpoint, s3_bucket, "idx/")
    with pytest.raises(unickpt.CheckpointError, match=r"writing index-.* AccessDenied"):
        unickpt.save(
            _IndexRefused(f"s3://{s3_bucket}/idx"), _state(2), config=CONFIG, overwrite=True
        )
    assert keys(s3_endpoint, s3_bucket, "idx/") == before, "only the earlier checkpoint"
    assert uploads(s3_endpoint, s3_bucket) == []
    dest = _blank()
    unickpt.load(f"s3://{s3_bucket}/idx", dest, config=CONFIG)
    _assert_same(dest, _state(1))


def test_async_save_and_failed_saves_leave_nothing(s3_endpoint: str, s3_bucket: str) -> None:
    bad = f"s3://{s3_bucket}/bad"
    async_and_refused_saves(f"s3://{s3_bucket}/async", bad, _state, _blank, _assert_same, CONFIG)
    assert keys(s3_endpoint, s3_bucket, "bad/") == []
    with pytest.raises(unickpt.CheckpointNotFoundError, match="missing or empty"):
        unickpt.load(bad, _blank())


def test_a_write_that_fails_aborts_its_upload(s3_endpoint: str, s3_bucket: str) -> None:
    s = open_storage(f"s3://{s3_bucket}/f")
    h = s.create("data-a-00000.bin", [5 * MiB, 5 * MiB, 7])
    h.write_part(1, [memoryview(bytes(5 * MiB))])
    assert uploads(s3_endpoint, s3_bucket) == ["f/data-a-00000.bin"]
    h.abort()
    assert uploads(s3_endpoint, s3_bucket) == [] and keys(s3_endpoint, s3_bucket) == []
    # a writer that died with an upload open: the next writer's lock aborts it
    s.create("data-b-00000.bin", [5 * MiB, 7]).write_part(0, [memoryview(bytes(5 * MiB))])
    assert uploads(s3_endpoint, s3_bucket) == ["f/data-b-00000.bin"]
    release = s.acquire_lock()
    assert uploads(s3_endpoint, s3_bucket) == []
    release()
    assert keys(s3_endpoint, s3_bucket) == []


def test_listing_pages(s3_bucket: str) -> None:
    s = S3Storage(f"s3://{s3_bucket}/many", page_size=2)
    for i in range(5):
        s.write_atomic(f"f{i}", b"x")
        s.child(f"d{i}").write_atomic("g", b"y")
    assert s.list_names() == [*(f"d{i}" for i in range(5)), *(f"f{i}" for i in range(5))]
    for i in range(3):
        s.create(f"u{i}", [5 * MiB, 1]).write_part(0, [memoryview(bytes(5 * MiB))])
    assert s.abort_uploads() == 3 and s.abort_uploads() == 0
    s.remove_tree("d1")
    assert "d1" not in s.list_names() and s.child("d2").read_bytes("g") == b"y"
    assert open_storage(f"s3://{s3_bucket}").list_names() == ["many"]


def test_the_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/locked"
    release = open_storage(url).acquire_lock()
    with pytest.raises(unickpt.CheckpointLockedError, match=r"being written by pid \d+ on"):
        open_storage(url).acquire_lock()
    with pytest.raises(unickpt.CheckpointLockedError, match="LOCK"):
        unickpt.save(url, {"w": torch.ones(2)})
    release()
    open_storage(url).acquire_lock()()  # released: free again
    # the holder refreshes its lock (every quarter of the stale bound), so a live writer's lock
    # never goes stale; the lock's age comes from whole-second HTTP times, and a busy machine
    # may delay a refresh by a second or two, so the bound leaves room for both
    quick = s3_settings(lock_stale_s=6.0)
    release = S3Storage(url, settings=quick).acquire_lock()
    time.sleep(7.0)
    with pytest.raises(unickpt.CheckpointLockedError, match=r"refreshed \d+ s ago") as refused:
        S3Storage(url, settings=quick).acquire_lock()
    age = re.search(r"refreshed (\d+) s ago", str(refused.value))
    assert age is not None and int(age.group(1)) < 6
    release()


def test_a_stale_lock_is_taken_over(s3_endpoint: str, s3_bucket: str) -> None:
    client = raw_client(s3_endpoint)
    client.put_object(Bucket=s3_bucket, Key="run/LOCK", Body=b'{"holder": "pid 1 on gone"}')
    fresh = S3Storage(f"s3://{s3_bucket}/run", settings=s3_settings(lock_stale_s=3600.0))
    with pytest.raises(unickpt.CheckpointLockedError, match="pid 1 on gone"):
        fresh.acquire_lock()
    time.sleep(1.5)
    stale = S3Storage(f"s3://{s3_bucket}/run", settings=s3_settings(lock_stale_s=1.0))
    release = stale.acquire_lock()
    assert b"gone" not in client.get_object(Bucket=s3_bucket, Key="run/LOCK")["Body"].read()
    release()
    assert keys(s3_endpoint, s3_bucket) == []


def test_checkpointer_and_command_line(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = f"s3://{s3_bucket}/run"

    def unfinished_upload(step: Storage) -> None:
        step.create("data-y-00000.bin", [5 * MiB, 1]).write_part(0, [memoryview(bytes(5 * MiB))])

    checkpointer_and_command_line(
        root, _state, _blank, _assert_same, CONFIG, capsys, unfinished_upload
    )
    assert uploads(s3_endpoint, s3_bucket) == [], "the writer's lock aborted it"
    assert not [k for k in keys(s3_endpoint, s3_bucket) if "/step-000000001/" in k]
    # convert from and to s3:// URLs
    out = tmp_path / "model.pt"
    assert main(["convert", root, str(out), "--to", "torch"]) == 0
    assert torch.equal(torch.load(out, weights_only=True)["big"], _state(4)["big"])
    back = f"s3://{s3_bucket}/imported-{uuid.uuid4().hex[:6]}"
    assert main(["convert", str(out), back, "--from", "torch"]) == 0
    capsys.readouterr()
    dest = _blank()
    unickpt.load(back, dest)
    _assert_same(dest, _state(4))


def test_incremental_checkpoints_refer_to_earlier_steps(s3_endpoint: str, s3_bucket: str) -> None:
    """A frozen tensor is written by the first save only; later steps refer to its bytes,
    load and verify whole, and retention keeps the step they refer to."""
    root = f"s3://{s3_bucket}/inc"
    ckpt = unickpt.Checkpointer(root, keep_last=1, incremental=True, mode="sync", config=CONFIG)
    state = _state(1)
    written = []
    for step in range(3):
        for t in state["small"].values():
            t.add_(1)
        report = ckpt.save(step, state).wait()
        assert report is not None
        written.append(report.bytes_written)
    big = state["big"].numel() * 4
    assert written[0] > big and all(n < big // 100 for n in written[1:]), written
    # keep_last=1: step 1 is deleted, step 0 stays while step 2 refers to it (as on disk)
    assert ckpt.steps() == [0, 2]
    assert not any("/step-000000001/" in k for k in keys(s3_endpoint, s3_bucket, "inc/"))
    dest = _blank()
    assert ckpt.load_latest(dest) == 2
    _assert_same(dest, state)
    assert verify_checkpoint(ckpt.path(2)).ok
    assert S3Storage(f"s3://{s3_bucket}/a/b").parent().location == f"s3://{s3_bucket}/a"  # type: ignore[union-attr]
    assert S3Storage(f"s3://{s3_bucket}/a").parent().location == f"s3://{s3_bucket}"  # type: ignore[union-attr]
    assert S3Storage(f"s3://{s3_bucket}").parent() is None
    ckpt.close()


def test_requests_tried_again_after_a_lost_answer(s3_endpoint: str, s3_bucket: str) -> None:
    """Completing an upload or taking the lock a second time, as a retry does when the first
    answer was lost, finds the work done and succeeds."""
    from unickpt.storage.s3_lock import S3Lock

    s = S3Storage(f"s3://{s3_bucket}/again")
    h = s.create("data-c-00000.bin", [5 * MiB, 7])
    h.write_part(0, [memoryview(bytes(5 * MiB))])
    h.write_part(1, [memoryview(b"1234567")])
    h.complete()
    h._complete()  # the upload is gone: the object of the right size is there
    assert s.size("data-c-00000.bin") == 5 * MiB + 7
    lock = S3Lock(s.client, s.settings, s3_bucket, "again/LOCK")
    etag = lock._take()
    assert lock._take() == etag, "the lock object holds this writer's token"
    with pytest.raises(unickpt.CheckpointLockedError):
        s.acquire_lock()


def test_urls(s3_endpoint: str) -> None:
    s = open_storage("s3://bkt/a/b/")
    assert isinstance(s, S3Storage) and (s.bucket, s.prefix) == ("bkt", "a/b")
    assert s.location == "s3://bkt/a/b" and s.child("c").location == "s3://bkt/a/b/c"
    assert open_storage("s3://bkt").location == "s3://bkt"
    with pytest.raises(unickpt.CheckpointError, match="names no bucket"):
        open_storage("s3:///x")
    with pytest.raises(unickpt.CheckpointError, match=r"NoSuchBucket.*does not exist"):
        open_storage("s3://no-such-bucket-here/x").write_atomic("f", b"1")
