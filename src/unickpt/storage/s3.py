"""Amazon S3 and S3-compatible stores: ``s3://bucket/prefix``.

A folder is a key prefix (``prefix/name`` is a file, ``prefix/sub/`` a sub-folder). Data files
of one part are a single PUT; larger ones are multipart uploads whose parts (at least 5 MiB,
at most 10,000) the engine's writer threads upload in parallel straight from the tensors'
memory; the object appears only when the upload is completed. Reads are ranged GETs of just
the bytes asked for. S3 has no rename, and needs none: small files are single PUTs (atomic),
and a checkpoint becomes visible when its ``COMMIT`` object is written, last.

A failed save aborts its multipart uploads; a killed one leaves them for the next writer, whose
lock on the folder (or on a Checkpointer root above it) aborts every upload left under the
prefix, as :meth:`S3Storage.remove_tree` does. The writer lock is a lock object created with
a conditional PUT (:mod:`.s3_lock`). Client settings, retries and errors: :mod:`.s3_client`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..errors import CheckpointError
from .base import STREAM_PART_BYTES, HeldLock, Storage, StreamHandle, WriteHandle, check_name
from .registry import register_backend
from .s3_client import (
    BufferStream,
    S3Settings,
    call,
    cleanup_settings,
    client_for,
    error_code,
    read_range,
    s3_settings,
)
from .s3_lock import S3Lock

log = logging.getLogger(__name__)

MiB = 1 << 20
LOCK_NAME = "LOCK"
_MISSING = ("NoSuchKey", "NotFound", "404")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``("bucket", "a/b")`` for ``s3://bucket/a/b/``."""
    if not url.startswith("s3://"):
        raise CheckpointError(f"{url} is not an s3:// URL; expected s3://bucket/prefix.")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise CheckpointError(f"{url} names no bucket; expected s3://bucket/prefix.")
    return bucket, prefix.strip("/")


class _Upload:
    """One multipart upload of object ``key``: started, parts uploaded (from several threads
    at once), completed with the parts in order, or discarded.

    The upload declares the checksum its parts carry (CRC32, as boto3's transfer manager
    does), so the server checks each part against it and keeps a checksum of the object
    combined from the parts' (a composite one). An upload that declares none is given a CRC64
    of the whole object instead (S3's default), which a server may compute when the upload is
    completed, a pass over every byte that delays the completion (moto does).
    """

    def __init__(self, store: S3Storage, key: str) -> None:
        self.location = f"s3://{store.bucket}/{key}"
        self._store, self._key = store, key
        self._lock = threading.Lock()
        self._parts: dict[int, dict[str, Any]] = {}
        self._done = False
        self._checksum = store.checksum_algorithm()
        self._extra = {"ChecksumAlgorithm": self._checksum} if self._checksum else {}
        self._completing = False
        tries = []

        def start() -> Any:
            tries.append(1)
            return store.client.create_multipart_upload(Bucket=store.bucket, Key=key, **self._extra)

        try:
            resp = store._call(f"starting the upload of {self.location}", start)
        except CheckpointError:
            # the upload may have been started with its answer lost: abort what is there
            self._abort_quietly(lambda: store.abort_uploads_of(key))
            raise
        self._upload_id = str(resp["UploadId"])
        if len(tries) > 1 or resp.get("ResponseMetadata", {}).get("RetryAttempts", 0):
            # a request sent again may have started an upload whose answer was lost
            store.abort_uploads_of(key, keep=self._upload_id)

    def upload_part(self, index: int, buffers: Sequence[memoryview]) -> None:
        """Upload part ``index`` (0-based) from ``buffers``."""
        s = self._store

        def upload() -> Any:
            return s.client.upload_part(
                Bucket=s.bucket,
                Key=self._key,
                UploadId=self._upload_id,
                PartNumber=index + 1,
                Body=BufferStream(buffers),
                **self._extra,
            )

        resp = s._call(f"uploading part {index + 1} of {self.location}", upload)
        part: dict[str, Any] = {"PartNumber": index + 1, "ETag": str(resp["ETag"])}
        member = f"Checksum{self._checksum}"
        if self._checksum and resp.get(member):
            part[member] = str(resp[member])
        with self._lock:
            self._parts[index] = part

    def complete(self, count: int, nbytes: int) -> None:
        """Complete the upload of parts ``0 .. count - 1``, ``nbytes`` in all."""
        parts = [self._parts[i] for i in range(count)]
        s = self._store

        def finish() -> None:
            try:
                s.client.complete_multipart_upload(
                    Bucket=s.bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except Exception as e:
                # a retry after a lost answer finds the upload already completed
                if error_code(e) != "NoSuchUpload" or not self._landed(nbytes):
                    raise

        self._completing = True  # from here on, the object may land even if the call fails
        s._call(f"completing the upload of {self.location}", finish)
        self._done = True

    def _landed(self, nbytes: int) -> bool:
        """Whether the object under the key is this upload, completed (the key is unique to
        this save, so an object of the file's size there is this one)."""
        head = self._store._head(self._key)
        return head is not None and int(head.get("ContentLength", -1)) == nbytes

    def discard(self) -> None:
        """Abort the upload; when it is gone because its completion landed (or may have),
        delete the object (the key is unique to this save)."""
        s = self._store

        def discard() -> None:
            was_open = s.abort_upload(self._key, self._upload_id)
            if self._done or (self._completing and not was_open):
                s.remove_key(self._key, cleanup=True)

        self._abort_quietly(discard)

    def _abort_quietly(self, cleanup: Callable[[], object]) -> None:
        try:
            cleanup()
        except CheckpointError as e:
            log.warning("%s; the next writer of %s removes it", e, self._store.location)


class _MultipartHandle(WriteHandle):
    """A data file of several parts: one multipart upload (:class:`_Upload`), parts uploaded
    in parallel."""

    def __init__(self, store: S3Storage, key: str, part_sizes: Sequence[int]) -> None:
        super().__init__(f"s3://{store.bucket}/{key}", part_sizes, store.min_part_bytes)
        self._upload = _Upload(store, key)

    def _write_part(self, index: int, buffers: list[memoryview]) -> None:
        self._upload.upload_part(index, buffers)

    def _complete(self) -> None:
        self._upload.complete(len(self.part_sizes), self.nbytes)

    def _discard(self) -> None:
        self._upload.discard()


class _StreamHandle(StreamHandle):
    """A data file written front to back: its bytes gathered into parts of
    :func:`stream_part_bytes` and each uploaded, as soon as it is full, on the store's upload
    threads (at most ``threads`` parts uploading, ``threads`` more held, then :meth:`append`
    waits). A file that never fills one part is a single PUT when completed; a larger one a
    multipart upload, started with its first part and completed last."""

    def __init__(self, store: S3Storage, key: str, threads: int) -> None:
        super().__init__(f"s3://{store.bucket}/{key}")
        self._store, self._key = store, key
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._count = 0
        self._upload: _Upload | None = None
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="unickpt-upload")
        self._slots = threading.BoundedSemaphore(2 * threads)
        self._futures: list[Future[None]] = []
        self._put = False

    def _append(self, buffers: list[memoryview]) -> None:
        for fut in self._futures:  # a failed upload stops the stream
            if fut.done() and fut.exception() is not None:
                fut.result()
        self._held.append(b"".join(buffers))
        self._held_bytes += len(self._held[-1])
        if self._held_bytes < stream_part_bytes(self._count, self._store):
            return
        data, at = memoryview(b"".join(self._held)), 0
        while len(data) - at >= (size := stream_part_bytes(self._count, self._store)):
            self._send(data[at : at + size])
            at += size
        self._held, self._held_bytes = [bytes(data[at:])], len(data) - at

    def _send(self, part: memoryview) -> None:
        if self._upload is None:
            self._upload = _Upload(self._store, self._key)
        upload, index = self._upload, self._count
        self._count += 1
        self._slots.acquire()

        def run() -> None:
            try:
                if not self.aborted:
                    upload.upload_part(index, [part])
            finally:
                self._slots.release()

        self._futures.append(self._pool.submit(run))

    def _complete(self) -> None:
        rest = memoryview(b"".join(self._held))
        self._held, self._held_bytes = [], 0
        if self._upload is None:
            s = self._store
            self._put = True  # from here on, the object may land even if the call fails
            s._call(
                f"writing {self.location}",
                lambda: s.client.put_object(Bucket=s.bucket, Key=self._key, Body=bytes(rest)),
            )
            self._pool.shutdown()
            return
        if len(rest):
            self._send(rest)
        for fut in self._futures:
            fut.result()
        self._pool.shutdown()
        self._upload.complete(self._count, self.nbytes)

    def _discard(self) -> None:
        self._held = []
        self._pool.shutdown(cancel_futures=True)  # waits for the parts uploading
        if self._upload is not None:
            self._upload.discard()
        elif self._put:
            try:  # a single PUT whose answer was lost, or an object completed then given up
                self._store.remove_key(self._key, cleanup=True)
            except CheckpointError as e:
                log.warning("%s; the next save's debris removal deletes it", e)


def stream_part_bytes(index: int, store: Storage) -> int:
    """The size of part ``index`` of a streamed upload: :data:`~.base.STREAM_PART_BYTES`
    (at least the store's minimum), doubled every 1,000 parts so that 10,000 parts hold any
    file up to S3's largest object (5 TiB), at most the store's largest part."""
    size = max(STREAM_PART_BYTES, store.min_part_bytes) << (index // 1000)
    return min(size, store.max_part_bytes) if store.max_part_bytes else size


class _SingleHandle(WriteHandle):
    """A data file of one part: a single PUT, made as the part is written."""

    def __init__(self, store: S3Storage, key: str, part_sizes: Sequence[int]) -> None:
        super().__init__(f"s3://{store.bucket}/{key}", part_sizes, 0)
        self._store, self._key = store, key

    def _write_part(self, index: int, buffers: list[memoryview]) -> None:
        s = self._store
        s._call(
            f"writing {self.location}",
            lambda: s.client.put_object(Bucket=s.bucket, Key=self._key, Body=BufferStream(buffers)),
        )

    def _complete(self) -> None:
        pass

    def _discard(self) -> None:
        try:
            self._store.remove_key(self._key, cleanup=True)
        except CheckpointError as e:
            log.warning("%s; the next save's debris removal deletes it", e)


@dataclass
class TransferStats:
    """Bytes moved by a storage and its children (``bytes_read``: ranged reads of data)."""

    bytes_read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, bytes_read: int) -> None:
        with self._lock:
            self.bytes_read += bytes_read


class S3Storage(Storage):
    """A folder in an S3 bucket, ``s3://bucket/prefix``.

    >>> unickpt.save("s3://my-bucket/runs/gpt/step-100", state)  # doctest: +SKIP

    The client is boto3's, configured the usual AWS way (environment, profile,
    ``AWS_ENDPOINT_URL`` for S3-compatible servers) and by ``UNICKPT_S3_*`` variables
    (:class:`~unickpt.storage.s3_client.S3Settings`).
    """

    min_part_bytes = 5 * MiB
    max_part_bytes = 5 * 1024 * MiB
    max_parts = 10_000
    upload_threads = 4
    """How many parts of a streamed data file (:meth:`create_stream`) upload at once."""

    def __init__(
        self,
        url: str,
        *,
        settings: S3Settings | None = None,
        client: Any = None,
        page_size: int | None = None,
        stats: TransferStats | None = None,
    ) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.settings = settings or s3_settings()
        self.client = client if client is not None else client_for(self.settings)
        self.page_size = page_size
        """Listing page size (None: the server's, 1,000 on S3); small in tests."""
        self.stats = stats or TransferStats()

    @property
    def location(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def checksum_algorithm(self) -> str | None:
        """The checksum a multipart upload declares: CRC32 when the client adds checksums to
        the requests that support them (botocore's default, ``request_checksum_calculation``
        ``when_supported``); None when it adds them only where required
        (``AWS_REQUEST_CHECKSUM_CALCULATION=when_required``, for servers without checksums)."""
        mode = getattr(self.client.meta.config, "request_checksum_calculation", None)
        return "CRC32" if mode in (None, "when_supported") else None

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{check_name(name)}" if self.prefix else check_name(name)

    def _folder(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        return call(self.settings, what, fn)

    def _cleanup(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` as a cleanup after a failure: tried again even where retries are off."""
        return call(cleanup_settings(self.settings), what, fn)

    def parent(self) -> S3Storage | None:
        """The prefix one level up (the bucket's top for a one-level prefix); None at the top."""
        if not self.prefix:
            return None
        head = self.prefix.rpartition("/")[0]
        return self._at(f"s3://{self.bucket}/{head}" if head else f"s3://{self.bucket}")

    def child(self, name: str) -> S3Storage:
        return self._at(f"s3://{self.bucket}/{self._key(name)}")

    def _at(self, url: str) -> S3Storage:
        """The folder at ``url`` through this one's client, settings and counters."""
        return S3Storage(
            url,
            settings=self.settings,
            client=self.client,
            page_size=self.page_size,
            stats=self.stats,
        )

    def list_names(self) -> list[str]:
        folder = self._folder()
        names: set[str] = set()
        for page in self._pages(
            "list_objects_v2", f"listing {self.location}", Prefix=folder, Delimiter="/"
        ):
            names.update(o["Key"][len(folder) :] for o in page.get("Contents", ()))
            names.update(
                p["Prefix"][len(folder) :].rstrip("/") for p in page.get("CommonPrefixes", ())
            )
        names.discard("")
        return sorted(names)

    def _pages(self, operation: str, what: str, **params: Any) -> list[dict[str, Any]]:
        """Every page of a paginated listing (each page's request retried on its own)."""
        token_in, token_out, size = _TOKENS[operation]
        pages: list[dict[str, Any]] = []
        extra: dict[str, Any] = {size: self.page_size} if self.page_size else {}
        while True:
            request = partial(
                getattr(self.client, operation), Bucket=self.bucket, **params, **extra
            )
            page = self._call(what, request)
            pages.append(page)
            if not page.get("IsTruncated"):
                return pages
            extra = {k: page[v] for k, v in zip(token_in, token_out) if page.get(v)}
            if self.page_size:
                extra[size] = self.page_size

    def _head(self, key: str) -> dict[str, Any] | None:
        def head() -> dict[str, Any] | None:
            try:
                return dict(self.client.head_object(Bucket=self.bucket, Key=key))
            except Exception as e:
                if error_code(e) in _MISSING:
                    return None
                raise

        result: dict[str, Any] | None = self._call(f"looking up s3://{self.bucket}/{key}", head)
        return result

    def size(self, name: str) -> int | None:
        head = self._head(self._key(name))
        return None if head is None else int(head["ContentLength"])

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if len(view):
            read_range(self.client, self.settings, self.bucket, self._key(name), offset, view)
            self.stats.add(bytes_read=len(view))

    def read_bytes(self, name: str) -> bytes | None:
        key = self._key(name)

        def get() -> bytes | None:
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=key)
            except Exception as e:
                if error_code(e) in _MISSING:
                    return None
                raise
            return bytes(resp["Body"].read())

        result: bytes | None = self._call(f"reading s3://{self.bucket}/{key}", get)
        return result

    def write_atomic(self, name: str, data: bytes) -> None:
        key = self._key(name)
        self._call(
            f"writing s3://{self.bucket}/{key}",
            lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=bytes(data)),
        )

    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        key = self._key(name)
        if len(part_sizes) == 1:
            return _SingleHandle(self, key, part_sizes)
        return _MultipartHandle(self, key, part_sizes)

    def create_stream(self, name: str) -> StreamHandle:
        """A streamed upload (parts uploaded as they fill, on ``upload_threads`` threads); a
        subclass whose :meth:`create` differs streams through it instead."""
        if self.streams_through_create(S3Storage):
            return super().create_stream(name)
        return _StreamHandle(self, self._key(name), self.upload_threads)

    def remove_key(self, key: str, cleanup: bool = False) -> None:
        """Delete object ``key``; ``cleanup``: after a failure, tried at least
        :data:`~.s3_client.CLEANUP_TRIES` times whatever the settings."""
        run = self._cleanup if cleanup else self._call
        run(
            f"deleting s3://{self.bucket}/{key}",
            lambda: self.client.delete_object(Bucket=self.bucket, Key=key),
        )

    def remove(self, name: str) -> None:
        self.remove_key(self._key(name))

    def remove_many(self, names: Sequence[str]) -> None:
        """Delete the files ``names`` with DeleteObjects, 1,000 per request."""
        self._delete_keys([self._key(n) for n in names], f"s3://{self.bucket}/{self._folder()}")

    def remove_tree(self, name: str) -> None:
        """Delete every object under ``name/`` (1,000 per request) and abort its uploads."""
        folder = f"{self._key(name)}/"
        self.abort_uploads(folder)
        for page in self._pages(
            "list_objects_v2", f"listing s3://{self.bucket}/{folder}", Prefix=folder
        ):
            self._delete_keys(
                [o["Key"] for o in page.get("Contents", ())], f"s3://{self.bucket}/{folder}"
            )

    def _delete_keys(self, keys: Sequence[str], where: str) -> None:
        """Delete ``keys`` (missing ones are no error), 1,000 per request; ``where`` names
        their folder in errors."""
        for i in range(0, len(keys), 1000):
            objects = [{"Key": k} for k in keys[i : i + 1000]]
            batch = {"Objects": objects, "Quiet": True}
            delete = partial(self.client.delete_objects, Bucket=self.bucket, Delete=batch)
            resp = self._call(f"deleting objects in {where}", delete)
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise CheckpointError(
                    f"deleting s3://{self.bucket}/{first.get('Key')} failed: "
                    f"{first.get('Code')} ({first.get('Message')}); check the bucket's "
                    "permissions and delete the files by hand."
                )

    def abort_uploads(self, prefix: str | None = None, keep: str | None = None) -> int:
        """Abort the unfinished multipart uploads under ``prefix`` (default: this folder), but
        the upload ``keep``; how many there were."""
        prefix = self._folder() if prefix is None else prefix
        pages = self._pages(
            "list_multipart_uploads",
            f"listing the uploads of s3://{self.bucket}/{prefix}",
            Prefix=prefix,
        )
        uploads = [
            (u["Key"], u["UploadId"])
            for page in pages
            for u in page.get("Uploads", ())
            if u["UploadId"] != keep
        ]
        for key, upload_id in uploads:
            log.info("aborting the unfinished upload of s3://%s/%s", self.bucket, key)
            self.abort_upload(key, upload_id)
        return len(uploads)

    def abort_uploads_of(self, key: str, keep: str | None = None) -> None:
        """Abort the unfinished uploads of object ``key`` but the upload ``keep`` (a failed
        or retried start may have opened one whose answer was lost); tried as a cleanup."""
        what = f"listing the uploads of s3://{self.bucket}/{key}"
        listing = partial(self.client.list_multipart_uploads, Bucket=self.bucket, Prefix=key)
        found = self._cleanup(what, listing).get("Uploads", ())
        for upload in found:
            if upload["Key"] == key and upload["UploadId"] != keep:
                log.info("aborting an upload of s3://%s/%s left by a start", self.bucket, key)
                self.abort_upload(key, upload["UploadId"])

    def abort_upload(self, key: str, upload_id: str) -> bool:
        """Abort an upload (tried as a cleanup); whether it was still open (False: it was
        completed or aborted already)."""

        def abort() -> bool:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception as e:
                if error_code(e) != "NoSuchUpload":  # gone already (or a retry after success)
                    raise
                return False
            return True

        was_open: bool = self._cleanup(f"aborting the upload of s3://{self.bucket}/{key}", abort)
        return was_open

    def acquire_lock(self) -> HeldLock:
        """The lock object ``LOCK`` (conditional PUT); then the uploads an earlier, killed
        writer left under the prefix are aborted (no other writer can own them now)."""
        held = S3Lock(self.client, self.settings, self.bucket, self._key(LOCK_NAME)).acquire()
        try:
            self.abort_uploads()
        except BaseException:
            held()
            raise
        return held

    def is_file(self) -> bool:
        return bool(self.prefix) and self._head(self.prefix) is not None


_TOKENS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    # operation: (request's page tokens, the response's tokens for them, page size parameter)
    "list_objects_v2": (("ContinuationToken",), ("NextContinuationToken",), "MaxKeys"),
    "list_multipart_uploads": (
        ("KeyMarker", "UploadIdMarker"),
        ("NextKeyMarker", "NextUploadIdMarker"),
        "MaxUploads",
    ),
}


register_backend("s3", S3Storage)

__all__ = ["S3Storage", "TransferStats", "parse_s3_url"]
