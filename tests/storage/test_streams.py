"""Data files written front to back (``Storage.create_stream``): on local files, the real moto
S3 server (a single PUT, and a multipart upload of parts larger than 5 MiB), fsspec, and the
buffered stream every other backend gets; nothing under the name before ``complete`` or after
``abort``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from unickpt.errors import CheckpointError
from unickpt.storage.base import BufferedStream, Storage, WriteHandle, stream_part_sizes
from unickpt.storage.fsspec import FsspecStorage
from unickpt.storage.local import LocalStorage, LocalStreamHandle
from unickpt.storage.s3 import S3Storage, stream_part_bytes

from .s3_server import keys, raw_client, uploads

MiB = 1 << 20


def _pieces(seed: int, sizes: Sequence[int]) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def _stream(storage: Storage, name: str, pieces: Sequence[bytes]) -> bytes:
    """Append ``pieces`` (two buffers per call) and complete; the bytes expected."""
    handle = storage.create_stream(name)
    for piece in pieces:
        half = len(piece) // 2
        handle.append([memoryview(piece)[:half], memoryview(piece)[half:]])
        assert storage.size(name) is None  # nothing under the name before complete
    handle.complete()
    assert handle.nbytes == sum(len(p) for p in pieces)
    return b"".join(pieces)


def _read(storage: Storage, name: str) -> bytes:
    size = storage.size(name)
    assert size is not None
    out = bytearray(size)
    storage.read_into(name, 0, memoryview(out))
    return bytes(out)


class _Plain(LocalStorage):
    """A local folder whose ``create`` is its own: its streams go through it."""

    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        return super().create(name, part_sizes)


def test_local_stream_writes_in_order_and_renames_at_the_end(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "f")
    handle = storage.create_stream("data.bin")
    assert isinstance(handle, LocalStreamHandle)
    handle.abort()
    expected = _stream(storage, "data.bin", _pieces(1, [0, 5, 4096, 3 * MiB + 7, 1]))
    assert _read(storage, "data.bin") == expected
    assert os.listdir(tmp_path / "f") == ["data.bin"]  # no temporary file left


def test_local_stream_aborted_leaves_nothing(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    handle = storage.create_stream("data.bin")
    handle.append([memoryview(b"x" * 100)])
    handle.abort()
    handle.abort()  # idempotent
    assert os.listdir(tmp_path) == []
    with pytest.raises(CheckpointError, match="aborted"):
        handle.append([memoryview(b"y")])


def test_a_subclass_with_its_own_create_streams_through_it(tmp_path: Path) -> None:
    storage = _Plain(tmp_path)
    assert isinstance(storage.create_stream("a"), BufferedStream)
    expected = _stream(storage, "a", _pieces(2, [10, 70000, 3]))
    assert _read(storage, "a") == expected
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_buffered_stream_cuts_the_parts_a_backend_takes() -> None:
    class Limits(LocalStorage):
        min_part_bytes, max_parts = 5 * MiB, 10

    storage = Limits("/nonexistent")
    assert stream_part_sizes(0, storage) == [0]
    assert stream_part_sizes(16 * MiB, storage) == [16 * MiB]
    assert stream_part_sizes(33 * MiB, storage) == [16 * MiB, 16 * MiB, MiB]
    big = stream_part_sizes(200 * MiB + 1, storage)
    assert len(big) <= 10 and sum(big) == 200 * MiB + 1 and min(big[:-1]) >= 5 * MiB


def test_fsspec_stream(tmp_path: Path) -> None:
    storage = FsspecStorage(f"file://{tmp_path}/f")
    expected = _stream(storage, "data.bin", _pieces(3, [1, MiB, 17]))
    assert _read(storage, "data.bin") == expected
    assert os.listdir(tmp_path / "f") == ["data.bin"]
    handle = storage.create_stream("gone.bin")
    handle.append([memoryview(b"abc")])
    handle.abort()
    assert os.listdir(tmp_path / "f") == ["data.bin"]


def _s3(endpoint: str, bucket: str, prefix: str = "streams") -> S3Storage:
    return S3Storage(f"s3://{bucket}/{prefix}", client=raw_client(endpoint))


def test_s3_stream_small_file_is_one_put(s3_endpoint: str, s3_bucket: str) -> None:
    storage = _s3(s3_endpoint, s3_bucket)
    expected = _stream(storage, "small.bin", _pieces(4, [3, 1000, 0, 20]))
    assert _read(storage, "small.bin") == expected
    assert keys(s3_endpoint, s3_bucket) == ["streams/small.bin"]
    assert uploads(s3_endpoint, s3_bucket) == []
    empty = storage.create_stream("empty.bin")
    empty.complete()
    assert storage.size("empty.bin") == 0


def test_s3_stream_multipart_upload(s3_endpoint: str, s3_bucket: str) -> None:
    storage = _s3(s3_endpoint, s3_bucket)
    part = stream_part_bytes(0, storage)
    assert part >= 5 * MiB
    sizes = [MiB + 3] * (2 * part // MiB) + [part // 2 + 11]  # parts cut across appends
    expected = _stream(storage, "big.bin", _pieces(5, sizes))
    assert len(expected) > 2 * part
    assert _read(storage, "big.bin") == expected
    assert keys(s3_endpoint, s3_bucket) == ["streams/big.bin"]
    assert uploads(s3_endpoint, s3_bucket) == []
    head = raw_client(s3_endpoint).head_object(Bucket=s3_bucket, Key="streams/big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # three parts: two full, the rest


def test_s3_stream_aborted_leaves_no_object_and_no_upload(s3_endpoint: str, s3_bucket: str) -> None:
    storage = _s3(s3_endpoint, s3_bucket)
    handle = storage.create_stream("big.bin")
    for piece in _pieces(6, [stream_part_bytes(0, storage) + MiB] * 2):
        handle.append([memoryview(piece)])
    assert uploads(s3_endpoint, s3_bucket) == ["streams/big.bin"]
    handle.abort()
    assert keys(s3_endpoint, s3_bucket) == []
    assert uploads(s3_endpoint, s3_bucket) == []


def test_s3_stream_part_sizes_reach_the_largest_object() -> None:
    storage = S3Storage.__new__(S3Storage)
    sizes = [stream_part_bytes(i, storage) for i in range(10_000)]
    assert min(sizes) >= 5 * MiB and max(sizes) <= 5 * 1024 * MiB
    assert sum(sizes) >= 5 * (1 << 40)  # 5 TiB, S3's largest object


def test_a_stream_that_cannot_be_created_says_so(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CheckpointError, match="creating"):
        LocalStorage(tmp_path / "file").create_stream("x")
