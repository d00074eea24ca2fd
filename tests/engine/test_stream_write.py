"""Compressed saves stream their data file: chunks compressed segment by segment while the
stored segments are appended in file order. The file, its offsets and its index are those the
compress-then-write path wrote; round trips on local files and S3 (a multipart upload); a
failure in the middle leaves nothing under the file's name and no committed checkpoint."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import unickpt
from tests.storage.s3_server import keys, moto_server, new_bucket, raw_client, uploads
from unickpt.config import Config, get_config
from unickpt.engine.checksum import digest
from unickpt.engine.compress import MIN_GAIN, encode_unit
from unickpt.errors import CheckpointError
from unickpt.planning.save_plan import CHUNK_ALIGN
from unickpt.storage.base import StreamHandle
from unickpt.storage.local import LocalStorage
from unickpt.storage.s3 import S3Storage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SEG = 4096
MiB = 1 << 20


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("moto.server")
    with moto_server() as url:
        yield url


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    return new_bucket(s3_endpoint)


def _small_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3000, 7, generator=g) * 0.02
    return {
        "f32": w,
        "bf16": w.to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "random bytes": torch.randint(0, 256, (9000,), generator=g, dtype=torch.uint8),
        "zeros": torch.zeros(33, 65),
        "i64": torch.arange(1500, dtype=torch.int64),
    }


# What the compress-then-write path (every chunk compressed, then the file written) wrote for
# _small_state() at segment_bytes=4096, with zstandard 0.25.0 (zstd 1.5.7): the data file's
# SHA-256, and its index's (the data file's name blanked, keys sorted).
_BEFORE_ZSTD = "1.5.7"
_BEFORE_DATA = ("da613e9b73a279bc40470e2d0ef1de3e6f31211e945ea2d083a3c285b687a595", 122105)
_BEFORE_INDEX = "75e48b77ab6b74d91eef2e09ccd0667b8373e0a12339a63ea48fba120aadaa08"


def _files(folder: Path) -> tuple[bytes, dict[str, Any]]:
    (data,) = folder.glob("data-*.bin")
    (index,) = folder.glob("index-*.json")
    return data.read_bytes(), json.loads(index.read_text())


def _expected_file(state: dict[str, torch.Tensor], index: dict[str, Any]) -> bytes:
    """The data file as docs/format.md describes it, built here from the index's chunk order:
    each chunk at the next multiple of CHUNK_ALIGN, each segment a zstd frame of its grouped
    bytes where that saves MIN_GAIN, else raw."""
    out = bytearray()
    for key, *_ in index["chunks"]:
        raw = state[key].contiguous().view(-1).view(torch.uint8).numpy()
        out += bytes(-len(out) % CHUNK_ALIGN)
        for at in range(0, len(raw), SEG):
            piece = raw[at : at + SEG]
            frame = encode_unit(piece, state[key].element_size())
            keep = len(frame) <= len(piece) * (1 - MIN_GAIN)
            out += frame if keep else piece.tobytes()
    return bytes(out)


def _stored_digests(data: bytes, entry: list[Any]) -> list[str]:
    offset, nbytes = entry[3], entry[4]
    raw = [min(SEG, nbytes - a) for a in range(0, nbytes, SEG)] or [0]
    stored = entry[7]["stored"] if len(entry) > 7 else raw
    ends = [offset, *(offset + int(n) for n in np.cumsum(stored))]
    return [digest(memoryview(data[a:b])) for a, b in itertools.pairwise(ends)]


def test_the_stored_file_is_the_one_written_before(tmp_path: Path) -> None:
    state = _small_state()
    unickpt.save(tmp_path / "c", state, compress=True, config=get_config(segment_bytes=SEG))
    data, index = _files(tmp_path / "c")
    assert data == _expected_file(state, index)
    for entry in index["chunks"]:  # each segment's checksum covers its stored bytes
        assert entry[5] == _stored_digests(data, entry), entry[0]
    import zstandard

    if ".".join(map(str, zstandard.ZSTD_VERSION)) != _BEFORE_ZSTD:
        pytest.skip(f"the recorded file was compressed by zstd {_BEFORE_ZSTD}")
    assert (hashlib.sha256(data).hexdigest(), len(data)) == _BEFORE_DATA
    index["data"] = ""
    assert hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest() == _BEFORE_INDEX


def _large_state() -> dict[str, torch.Tensor]:
    """About 26 MiB stored: more than one part of a streamed S3 upload."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(2048, 1024, generator=g) * 0.02
    return {
        "noise": torch.randint(0, 256, (20 * MiB,), generator=g, dtype=torch.uint8),
        "w": w,
        "w16": w.to(torch.bfloat16),
        "step": torch.tensor(3),
    }


def _round_trip(where: Any, state: dict[str, torch.Tensor], config: Config) -> None:
    unickpt.save(where, state, compress=True, config=config)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    unickpt.load(where, dest, config=config)
    for k, v in state.items():
        assert torch.equal(
            dest[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
        ), k


def test_compressed_round_trip_on_local_files(tmp_path: Path) -> None:
    _round_trip(tmp_path / "c", _large_state(), get_config())
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".")]


def test_compressed_round_trip_on_s3_multipart(s3_endpoint: str, s3_bucket: str) -> None:
    storage = S3Storage(f"s3://{s3_bucket}/ckpt", client=raw_client(s3_endpoint))
    _round_trip(storage, _large_state(), get_config())
    (data,) = [k for k in keys(s3_endpoint, s3_bucket) if "/data-" in k]
    head = raw_client(s3_endpoint).head_object(Bucket=s3_bucket, Key=data)
    assert head["ContentLength"] > 16 * MiB and head["ETag"].strip('"').endswith("-2")
    assert uploads(s3_endpoint, s3_bucket) == []


class _FailingAppends(StreamHandle):
    """A stream whose ``fail_at``-th append fails, as a storage error would."""

    def __init__(self, inner: StreamHandle, fail_at: int) -> None:
        super().__init__(inner.location)
        self.inner, self.fail_at, self.appends = inner, fail_at, 0

    def _append(self, buffers: list[memoryview]) -> None:
        self.appends += 1
        if self.appends == self.fail_at:
            raise CheckpointError(f"writing {self.location} failed: injected (503 Slow Down)")
        self.inner.append(buffers)

    def _complete(self) -> None:
        self.inner.complete()

    def _discard(self) -> None:
        self.inner.abort()


class _LocalFailing(LocalStorage):
    fail_at = 3

    def create_stream(self, name: str) -> StreamHandle:
        return _FailingAppends(super().create_stream(name), self.fail_at)

    def child(self, name: str) -> _LocalFailing:
        return _LocalFailing(self.root / name)


class _S3Failing(S3Storage):
    fail_at = 3
    opened: list[_FailingAppends] = []

    def create_stream(self, name: str) -> StreamHandle:
        handle = _FailingAppends(super().create_stream(name), self.fail_at)
        self.opened.append(handle)
        return handle


def test_a_failed_append_leaves_nothing_on_local_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="injected"):
        unickpt.save(_LocalFailing(tmp_path / "c"), _small_state(), compress=True)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["LOCK"]  # no data, no COMMIT


@pytest.mark.parametrize("fail_at", [3, 24])  # 24: after the first part is uploading
def test_a_failed_append_leaves_nothing_on_s3(
    s3_endpoint: str, s3_bucket: str, fail_at: int
) -> None:
    storage = _S3Failing(f"s3://{s3_bucket}/ckpt", client=raw_client(s3_endpoint))
    storage.fail_at, storage.opened = fail_at, []
    with pytest.raises(CheckpointError, match="injected"):
        unickpt.save(storage, _large_state(), compress=True)
    (handle,) = storage.opened
    assert (handle.inner.nbytes > 16 * MiB) == (fail_at > 3)  # a part was uploaded, or none
    assert keys(s3_endpoint, s3_bucket) == []
    assert uploads(s3_endpoint, s3_bucket) == []
