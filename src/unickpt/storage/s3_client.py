"""The S3 client of the ``s3://`` backend: settings, retries, errors, upload and ranged reads.

Credentials, region and endpoint come the usual AWS way (``AWS_ACCESS_KEY_ID`` and friends,
``AWS_PROFILE`` and ``~/.aws/config``, ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``); the
client's own knobs are :class:`S3Settings`, overridden by ``UNICKPT_S3_<FIELD>`` variables.

Retries come in two layers. botocore's "standard" mode retries every request on throttling
(503 SlowDown), 500/502/504 and dropped connections, with jittered exponential backoff, up to
``max_attempts`` attempts. It also keeps a retry quota that many failures drain, after which
it stops retrying; so around it, :func:`call` tries a request botocore gave up on again, with
its own backoff, until ``max_attempts * rounds`` tries have failed, and :func:`read_range`
resumes a ranged GET whose body was cut off mid-stream from the first byte it did not get.
"""

from __future__ import annotations

import bisect
import io
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, replace
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
from urllib3.exceptions import HTTPError as Urllib3Error

from ..config import env_overrides
from ..errors import CheckpointCorruptError, CheckpointError

log = logging.getLogger(__name__)

T = TypeVar("T")
MiB = 1 << 20
_READ_STEP = 8 * MiB
_MAX_BACKOFF_S = 8.0
CLEANUP_TRIES = 4
"""The fewest tries of a request that cleans up after a failure, whatever the settings."""


@dataclass(frozen=True)
class S3Settings:
    """Knobs of the S3 client; each can be set as ``UNICKPT_S3_<FIELD>`` in the environment."""

    max_attempts: int = 8
    """Attempts per request inside botocore (503 SlowDown, 500s, dropped connections)."""
    rounds: int = 3
    """A request botocore gave up on is tried again until ``max_attempts * rounds`` tries
    failed (botocore gives up early once many failures drain its retry quota)."""
    backoff_s: float = 0.5
    """First wait between those tries (doubled each time up to 8 s, jittered)."""
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0
    max_pool_connections: int = 64
    """Connections kept to the endpoint; at least the engine's ``io_threads`` per process."""
    lock_stale_s: float = 600.0
    """A writer lock not refreshed for this long belongs to a dead writer and is taken over."""
    lock_refresh_s: float = 30.0
    """The holder rewrites its lock this often (at most every quarter of ``lock_stale_s``); a
    restart of the same run on another host takes the lock over once three of these went by
    without a refresh."""
    addressing_style: str = "auto"
    """``auto``, ``path`` or ``virtual`` (some S3-compatible servers want ``path``)."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.rounds < 1:
            raise CheckpointError(
                f"S3 max_attempts is {self.max_attempts} and rounds {self.rounds}; expected at "
                "least 1 each."
            )
        if self.lock_stale_s <= 0 or self.lock_refresh_s <= 0 or self.backoff_s < 0:
            raise CheckpointError(
                "S3 lock_stale_s and lock_refresh_s must be positive and backoff_s not negative."
            )
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise CheckpointError(
                f"S3 addressing_style is {self.addressing_style!r}; expected auto, path or virtual."
            )


def s3_settings(**overrides: Any) -> S3Settings:
    """The defaults, then ``UNICKPT_S3_*`` environment variables, then ``overrides``."""
    return S3Settings(**{**env_overrides(S3Settings, "UNICKPT_S3_"), **overrides})


def cleanup_settings(settings: S3Settings) -> S3Settings:
    """``settings`` for the requests that clean up after a failure (aborting an upload,
    deleting what a failed save wrote): at least :data:`CLEANUP_TRIES` tries even where
    retries are turned off, since a cleanup that fails leaves debris behind (an open upload
    is stored, and billed, until aborted)."""
    rounds = max(settings.rounds, -(-CLEANUP_TRIES // settings.max_attempts))
    return replace(settings, rounds=rounds)


_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()


_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
)


def client_for(settings: S3Settings, endpoint_url: str | None = None) -> Any:
    """One thread-safe boto3 S3 client per process, settings and AWS environment (a fork, or
    another endpoint or profile in the environment, makes a new one). ``endpoint_url``
    overrides the environment's endpoint."""
    key = (os.getpid(), astuple(settings), endpoint_url, *(os.environ.get(v) for v in _ENV))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            config = botocore.config.Config(
                retries={"mode": "standard", "total_max_attempts": settings.max_attempts},
                connect_timeout=settings.connect_timeout_s,
                read_timeout=settings.read_timeout_s,
                max_pool_connections=settings.max_pool_connections,
                s3={"addressing_style": settings.addressing_style},
            )
            session = boto3.session.Session()
            client = session.client("s3", endpoint_url=endpoint_url, config=config)
            _CLIENTS[key] = client
        return client


def error_code(e: BaseException) -> str:
    """The S3 error code of a client error (``NoSuchKey``, ``SlowDown``, ...), else ``""``."""
    if isinstance(e, botocore.exceptions.ClientError):
        return str(e.response.get("Error", {}).get("Code", ""))
    return ""


def http_status(e: BaseException) -> int:
    if isinstance(e, botocore.exceptions.ClientError):
        return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def is_transient(e: BaseException) -> bool:
    """Throttling, a server error or a dropped connection: worth another try."""
    if isinstance(
        e,
        (
            botocore.exceptions.ConnectionError,
            botocore.exceptions.HTTPClientError,
            botocore.exceptions.IncompleteReadError,
            botocore.exceptions.ResponseStreamingError,
            Urllib3Error,
            ConnectionError,
        ),
    ):
        return True
    return http_status(e) >= 500 or error_code(e) in ("SlowDown", "RequestTimeout", "Throttling")


def s3_error(e: BaseException, what: str) -> CheckpointError:
    """A :class:`CheckpointError` that says what failed and what to do about it."""
    code, status = error_code(e), http_status(e)
    if isinstance(e, botocore.exceptions.NoCredentialsError):
        hint = (
            "no AWS credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or AWS_PROFILE, or run where an instance role applies."
        )
    elif code == "NoSuchBucket":
        hint = "the bucket does not exist: create it or fix the URL."
    elif code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
        hint = "access was denied: check the credentials and the bucket's policy."
    elif is_transient(e):
        hint = (
            "the endpoint kept failing (throttling, server errors or dropped connections) "
            "through every retry; an earlier committed checkpoint, if any, is untouched. Try again "
            "later, or raise UNICKPT_S3_MAX_ATTEMPTS / UNICKPT_S3_ROUNDS."
        )
    else:
        hint = "check the URL, the endpoint (AWS_ENDPOINT_URL) and the credentials."
    found = f"{code} (HTTP {status})" if code else f"{type(e).__name__}: {e}"
    return CheckpointError(f"{what} failed: {found}; {hint}")


def backoff(settings: S3Settings, failures: int) -> None:
    """Wait before the next try after ``failures`` failed ones (from 1)."""
    wait_s = min(settings.backoff_s * 2 ** min(failures - 1, 10), _MAX_BACKOFF_S)
    time.sleep(wait_s * (0.5 + random.random() / 2))


def call(settings: S3Settings, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, tried again on transient failures botocore gave up on; errors explained."""
    tries = settings.max_attempts * settings.rounds
    for failures in range(1, tries + 1):
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as e:
            if not is_transient(e) or failures == tries:
                raise s3_error(e, what) from e
            log.warning("%s: %s; trying again", what, e)
            backoff(settings, failures)
    raise AssertionError("unreachable")


def read_range(
    client: Any, settings: S3Settings, bucket: str, key: str, offset: int, out: memoryview
) -> None:
    """Fill ``out`` from bytes ``[offset, offset + len(out))`` of the object with ranged GETs;
    a body cut off mid-stream is resumed from its first missing byte."""
    where = f"s3://{bucket}/{key}"
    done, failures = 0, 0
    while done < len(out):
        first, last = offset + done, offset + len(out) - 1
        try:
            resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={first}-{last}")
            got = _drain(resp["Body"], out[done:])
        except _Partial as p:
            done += p.got
            cause: Exception = p.cause
        except Exception as e:  # noqa: BLE001 - sorted below: retried, explained or raised
            cause = e
        else:
            done += got
            if done < len(out):  # the body ended cleanly, short: the object ends early
                raise _truncated(where, offset + done, offset + len(out))
            continue
        if error_code(cause) in ("NoSuchKey", "NotFound"):
            raise CheckpointCorruptError(
                f"{where} is missing, but the checkpoint's metadata names it; the checkpoint "
                "is incomplete. Load an earlier checkpoint."
            ) from None
        if error_code(cause) == "InvalidRange":
            raise _truncated(where, None, offset + len(out)) from None
        failures += 1
        if not is_transient(cause) or failures >= settings.max_attempts * settings.rounds:
            raise s3_error(cause, f"reading {where}") from cause
        log.info("reading %s: %s at byte %d; resuming", where, type(cause).__name__, first)
        backoff(settings, failures)


def _drain(body: Any, out: memoryview) -> int:
    """Copy the response body into ``out``; raise :class:`_Partial` (with the bytes received
    so far) when it is cut off."""
    got = 0
    try:
        while got < len(out):
            chunk = body.read(min(_READ_STEP, len(out) - got))
            if not chunk:
                break
            out[got : got + len(chunk)] = chunk
            got += len(chunk)
    except Exception as e:
        raise _Partial(got, e) from e
    finally:
        body.close()
    return got


class _Partial(Exception):
    """A body cut off after ``got`` bytes; ``read_range`` keeps them and resumes."""

    def __init__(self, got: int, cause: Exception) -> None:
        super().__init__(str(cause))
        self.got = got
        self.cause = cause


def _truncated(where: str, end: int | None, wanted: int) -> CheckpointCorruptError:
    ends = f"ends at byte {end}" if end is not None else "is shorter"
    return CheckpointCorruptError(
        f"{where} {ends}, but bytes up to {wanted} were expected; the file is truncated. Load "
        "an earlier checkpoint."
    )


class BufferStream(io.RawIOBase):
    """A seekable, read-only file over a list of buffers, so botocore uploads (and re-sends
    on retry) the tensors' own memory without joining it into one copy."""

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        super().__init__()
        self._buffers = [b for b in buffers if b.nbytes]
        self._starts = [0]
        for b in self._buffers:
            self._starts.append(self._starts[-1] + b.nbytes)
        self._pos = 0

    def __len__(self) -> int:
        return self._starts[-1]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, out: Any) -> int:
        view = memoryview(out).cast("B")
        n = 0
        while n < len(view) and self._pos < len(self):
            i = _find(self._starts, self._pos)
            buf = self._buffers[i]
            at = self._pos - self._starts[i]
            k = min(len(view) - n, buf.nbytes - at)
            view[n : n + k] = buf[at : at + k]
            n += k
            self._pos += k
        return n

    def read(self, size: int = -1) -> bytes:
        """The next ``size`` bytes: a view of the buffer itself when they lie in one (the
        HTTP client sends and hashes views as they are), else a joined copy."""
        left = len(self) - self._pos
        size = left if size is None or size < 0 else min(size, left)
        pieces = []
        while size > 0:
            i = _find(self._starts, self._pos)
            at = self._pos - self._starts[i]
            k = min(size, self._buffers[i].nbytes - at)
            pieces.append(self._buffers[i][at : at + k])
            self._pos += k
            size -= k
        if len(pieces) == 1:
            return pieces[0]  # type: ignore[return-value]  # bytes-like, read-only, no copy
        return b"".join(pieces)


def _find(starts: list[int], pos: int) -> int:
    """The index of the buffer that holds byte ``pos`` (``starts`` ascending, ``pos`` below
    the last)."""
    return bisect.bisect_right(starts, pos) - 1
