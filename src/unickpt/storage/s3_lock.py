"""The writer lock of an S3 folder: a lock object created with a conditional PUT.

A writer reads ``<prefix>/LOCK`` first. When there is none, it creates it with
``PUT If-None-Match: *``, which succeeds for one writer only. When there is one, its holder
(:mod:`.holder`) is taken over with a PUT conditional on the object's ETag (``If-Match``, so
of two writers racing for it one wins) when it is dead:

- it has not been refreshed for ``lock_stale_s`` (by the server's clock): its writer died;
- it belongs to this writer's run (the same run id): this is the run's restart, which takes
  the lock at once rather than waiting for it to go stale (unless its process is on this
  host and still runs: then it is a second writer of the run in the same place);
- its process ran on this host and is gone (killed, crashed).

Otherwise the writer is refused with :class:`~unickpt.errors.CheckpointLockedError` naming
the holder, its host, run id and the lock's age, and what to do.

After its PUT, the writer reads the lock back and holds it only if the object holds its own
token: a server that ignores ``If-None-Match`` lets a second writer's PUT overwrite the
first's, and the read-back refuses whichever writer was overwritten. (Two writers whose PUTs
and read-backs interleave exactly can still both pass on such a server; S3 honours the
condition.) A request whose answer was lost and that is tried again finds the lock object
holding its own token, and counts as taken.

The holder rewrites the object every quarter of ``lock_stale_s`` with a new heartbeat count
(so its ETag changes, also on stores whose ETag is the content's MD5), conditional on the
ETag it last wrote, and keeps the new ETag; the release deletes the object only while it
still holds the holder's token, conditional on its current ETag.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

from ..errors import CheckpointError, CheckpointLockedError
from .holder import Holder, is_gone, is_restart_of, this_holder
from .s3_client import S3Settings, call, error_code

log = logging.getLogger(__name__)

_REFUSED = ("PreconditionFailed", "ConditionalRequestConflict")
_MISSING = ("NoSuchKey", "NotFound", "404")  # "404": an error answer cut short


class S3Lock:
    """The lock object ``key`` in ``bucket``; :meth:`acquire` returns the release."""

    def __init__(self, client: Any, settings: S3Settings, bucket: str, key: str) -> None:
        self.client, self.settings = client, settings
        self.bucket, self.key = bucket, key
        self.where = f"s3://{bucket}/{key}"
        self.holder = this_holder()
        self.since = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.token = uuid.uuid4().hex
        self._beats = 0
        self._etag = ""

    @property
    def body(self) -> bytes:
        """The lock object's content: the holder, since when, its token and heartbeat."""
        info = {**self.holder.to_json(), "since": self.since, "token": self.token}
        return json.dumps({**info, "beat": self._beats}).encode()

    def acquire(self) -> Callable[[], None]:
        self._etag = self._take()
        stop = threading.Event()
        beat = threading.Thread(
            target=self._refresh, args=(stop,), name="unickpt-s3-lock", daemon=True
        )
        beat.start()

        def release() -> None:
            stop.set()
            beat.join()
            self._delete()

        return release

    def _take(self) -> str:
        """Create the lock object, or take over a dead holder's; its ETag once read back."""
        for _ in range(5):
            current = self._read()
            if current is None:
                etag = self._put(IfNoneMatch="*")
            else:
                info, old_etag, age_s = current
                if info.get("token") == self.token:
                    return old_etag  # a PUT whose answer was lost landed
                self._check_takeover(info, age_s)
                etag = self._put(IfMatch=old_etag)
            if etag is not None:
                return self._confirm()
        raise CheckpointLockedError(
            f"{self.where} kept changing hands while this writer tried to take it; another "
            "job is saving into the same place. Stop it or choose another path."
        )

    def _check_takeover(self, info: dict[str, Any], age_s: float) -> None:
        """Return when the holder recorded in ``info`` is dead (logged); else refuse."""
        holder = Holder.from_json(info)
        if age_s >= self.settings.lock_stale_s:
            why = f"not refreshed for {age_s:.0f} s"
        elif is_restart_of(holder) and not _runs_here(holder):
            why = f"a restart of its run ({holder.run_id}) takes it over"
        elif is_gone(holder):
            why = f"its process {holder.pid} on this host is gone"
        else:
            raise self._locked(info, age_s)
        log.warning("%s: taking over the lock of %s: %s", self.where, info.get("holder"), why)

    def _confirm(self) -> str:
        """Read the lock back after writing it: the ETag when it holds this writer's token;
        else (a server that ignored the condition let another writer overwrite it) refuse."""
        current = self._read()
        if current is not None and current[0].get("token") == self.token:
            return current[1]
        info = current[0] if current is not None else {}
        raise CheckpointLockedError(
            f"{self.where} did not hold this writer's token when read back right after it was "
            f"written: {info.get('holder', 'another writer (it was deleted)')} "
            f"(run id {info.get('run_id') or 'none'}) wrote it over. The server may ignore "
            "conditional writes (If-None-Match); two jobs must not save into the same place. "
            "Stop the other job or choose another path."
        )

    def _put(self, **condition: str) -> str | None:
        """PUT the lock object under ``condition``; its ETag, or None when refused."""
        body = self.body

        def put() -> str | None:
            try:
                resp = self.client.put_object(
                    Bucket=self.bucket, Key=self.key, Body=body, **condition
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
                if error_code(e) in _MISSING:
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
        theirs = info.get("run_id") or "none"
        mine = self.holder.run_id or "none"
        return CheckpointLockedError(
            f"{self.where.rsplit('/', 1)[0]} is being written by {holder} (host "
            f"{info.get('host') or 'unknown'}, run id {theirs}; since {since}, lock refreshed "
            f"{age_s:.0f} s ago); this writer is {self.holder.name} (run id {mine}). Two jobs "
            "must not save into the same place: stop the other job or choose another path. "
            "If that job is gone and this is its restart, give both the same run id "
            "(UNICKPT_RUN_ID, or torchrun's TORCHELASTIC_RUN_ID, or SLURM_JOB_ID) and the "
            f"restart takes the lock at once. A lock not refreshed for "
            f"{self.settings.lock_stale_s:.0f} s (UNICKPT_S3_LOCK_STALE_S) is taken over; if "
            f"its holder is surely gone, delete {self.where}."
        )

    def _refresh(self, stop: threading.Event) -> None:
        """Rewrite the lock object with the next heartbeat, conditional on the ETag last
        written, so that it stays fresh; keep the new ETag."""
        period_s = self.settings.lock_stale_s / 4
        while not stop.wait(period_s):
            try:
                if not self._beat():
                    log.error(
                        "%s was taken over by another writer; this save may clash", self.where
                    )
                    return
            except Exception as e:  # noqa: BLE001 - logged; the next refresh tries again
                log.warning("refreshing %s failed: %s", self.where, e)

    def _beat(self) -> bool:
        """One refresh; False when the lock is no longer this writer's."""
        self._beats += 1
        etag = self._put(IfMatch=self._etag)
        if etag is None:  # refused: taken over, or a retried PUT whose first answer was lost
            current = self._read()
            if current is None or current[0].get("token") != self.token:
                return False
            etag = current[1]
        self._etag = etag
        return True

    def _delete(self) -> None:
        """Delete the lock object if it still holds this writer's token, conditional on its
        current ETag (a taken-over lock is left alone)."""
        try:
            current = self._read()
            if current is None or current[0].get("token") != self.token:
                log.warning("%s is no longer this writer's lock; left as it is", self.where)
                return
            etag = current[1]

            def delete() -> None:
                try:
                    self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=etag)
                except Exception as e:
                    if error_code(e) not in (*_REFUSED, *_MISSING):
                        raise

            call(self.settings, f"releasing {self.where}", delete)
        except CheckpointError as e:  # a release logs, never raises
            log.warning("%s; delete %s if no job is saving there", e, self.where)


def _runs_here(holder: Holder) -> bool:
    """Whether ``holder``'s process provably still runs (on this host)."""
    me = this_holder()
    same_machine = holder.host == me.host and holder.pid_namespace == me.pid_namespace
    return same_machine and holder.pid is not None and not is_gone(holder)
