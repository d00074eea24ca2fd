"""The writer lock of an S3 folder: a lock object created with a conditional PUT.

``PUT <prefix>/LOCK`` with ``If-None-Match: *`` succeeds for one writer only; the others are
refused with :class:`~unickpt.errors.CheckpointLockedError` naming the holder (host, process,
since when). The holder refreshes the object every quarter of ``lock_stale_s``; an object that
has not been refreshed for ``lock_stale_s`` (by the server's clock) belongs to a writer that
died, and the next writer takes it over with a PUT conditional on its ETag (``If-Match``), so
of two writers racing for a stale lock one wins. A request whose answer was lost and that is
tried again finds the lock object holding its own token, and counts as taken.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

from ..errors import CheckpointLockedError
from .s3_client import S3Settings, backoff, call, error_code, s3_error

log = logging.getLogger(__name__)

_REFUSED = ("PreconditionFailed", "ConditionalRequestConflict")


class S3Lock:
    """The lock object ``key`` in ``bucket``; :meth:`acquire` returns the release."""

    def __init__(self, client: Any, settings: S3Settings, bucket: str, key: str) -> None:
        self.client, self.settings = client, settings
        self.bucket, self.key = bucket, key
        self.where = f"s3://{bucket}/{key}"
        holder = f"pid {os.getpid()} on {socket.gethostname()}"
        since = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.token = uuid.uuid4().hex
        self.body = json.dumps({"holder": holder, "since": since, "token": self.token}).encode()

    def acquire(self) -> Callable[[], None]:
        etag = self._take()
        stop = threading.Event()
        beat = threading.Thread(
            target=self._refresh, args=(etag, stop), name="unickpt-s3-lock", daemon=True
        )
        beat.start()

        def release() -> None:
            stop.set()
            beat.join()
            self._delete(etag)

        return release

    def _take(self) -> str:
        """Create the lock object, or take over a stale one; its ETag."""
        for _ in range(5):
            if (etag := self._put(IfNoneMatch="*")) is not None:
                return etag
            current = self._read()
            if current is None:
                continue  # released meanwhile: try again
            info, old_etag, age_s = current
            if info.get("token") == self.token:
                return old_etag
            if age_s < self.settings.lock_stale_s:
                raise self._locked(info, age_s)
            log.warning(
                "%s: taking over a lock not refreshed for %.0f s (held by %s)",
                self.where,
                age_s,
                info.get("holder"),
            )
            if (etag := self._put(IfMatch=old_etag)) is not None:
                return etag
        raise CheckpointLockedError(
            f"{self.where} kept changing hands while this writer tried to take it; another "
            "job is saving into the same place. Stop it or choose another path."
        )

    def _put(self, **condition: str) -> str | None:
        """PUT the lock object under ``condition``; its ETag, or None when refused."""

        def put() -> str | None:
            try:
                resp = self.client.put_object(
                    Bucket=self.bucket, Key=self.key, Body=self.body, **condition
                )
            except Exception as e:
                if error_code(e) in _REFUSED:
                    return None
                raise
            return str(resp["ETag"])

        return call(self.settings, f"locking {self.where}", put)

    def _read(self) -> tuple[dict[str, Any], str, float] | None:
        """The lock object's content, ETag and age in seconds; None when there is none."""

        def get() -> tuple[dict[str, Any], str, float] | None:
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=self.key)
            except Exception as e:
                if error_code(e) in ("NoSuchKey", "NotFound"):
                    return None
                raise
            raw = resp["Body"].read()
            now = parsedate_to_datetime(resp["ResponseMetadata"]["HTTPHeaders"]["date"])
            age_s = (now - resp["LastModified"]).total_seconds()
            try:
                info = json.loads(raw)
            except ValueError:
                info = {"holder": raw[:200].decode(errors="replace")}
            return info if isinstance(info, dict) else {}, str(resp["ETag"]), age_s

        return call(self.settings, f"reading the lock {self.where}", get)

    def _locked(self, info: dict[str, Any], age_s: float) -> CheckpointLockedError:
        holder = info.get("holder", "another writer")
        since = info.get("since", "an unknown time")
        return CheckpointLockedError(
            f"{self.where.rsplit('/', 1)[0]} is being written by {holder} (since {since}, lock "
            f"refreshed {age_s:.0f} s ago); two jobs must not save into the same place. Stop "
            f"the other job or choose another path. A lock not refreshed for "
            f"{self.settings.lock_stale_s:.0f} s (UNICKPT_S3_LOCK_STALE_S) is taken over; if "
            f"its holder is surely gone, delete {self.where}."
        )

    def _refresh(self, etag: str, stop: threading.Event) -> None:
        """Rewrite the lock object (same content, same ETag) so that it stays fresh."""
        period_s = self.settings.lock_stale_s / 4
        while not stop.wait(period_s):
            try:
                if self._put(IfMatch=etag) is None:
                    log.error(
                        "%s was taken over by another writer; this save may clash", self.where
                    )
                    return
            except Exception as e:  # noqa: BLE001 - logged; the next refresh tries again
                log.warning("refreshing %s failed: %s", self.where, e)

    def _delete(self, etag: str) -> None:
        """Delete the lock object if it is still ours (a taken-over one is left alone)."""
        for round_ in range(self.settings.rounds):
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=etag)
                return
            except Exception as e:  # noqa: BLE001 - a release logs, never raises
                if error_code(e) in (*_REFUSED, "NoSuchKey", "NotFound"):
                    return
                if round_ == self.settings.rounds - 1:
                    log.warning("%s", s3_error(e, f"releasing {self.where}"))
                    return
                backoff(self.settings, round_ + 1)
