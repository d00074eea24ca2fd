"""The writer lock of an S3 folder: a lock object created with a conditional PUT.

A writer reads ``<prefix>/LOCK`` first. When there is none, it creates it with
``PUT If-None-Match: *``, which succeeds for one writer only. When there is one, its holder
(:mod:`.holder`) is taken over with a PUT conditional on the object's ETag (``If-Match``, so
of two writers racing for it one wins) when it is dead:

- it has not been refreshed for ``lock_stale_s`` (by the server's clock): its writer died;
- its process ran on this host and is gone (killed, crashed);
- it belongs to this writer's run (the same run id) and ran on another host (or in another
  pid namespace), and its heartbeat has stopped: this is the run's restart. The writer waits
  (logged) until the lock has gone three of its holder's refresh periods without a refresh; a
  refresh meanwhile means the holder is alive, and the writer is refused. A writer of the run
  on this host whose process still runs is refused at once (a second writer in one place).

Otherwise the writer is refused with :class:`~unickpt.errors.CheckpointLockedError` naming
the holder, its host, run id and the lock's age, and what to do.

After its PUT, the writer reads the lock back and holds it only if the object holds its own
token: a server that ignores ``If-None-Match`` lets a second writer's PUT overwrite the
first's, and the read-back refuses whichever writer was overwritten. (Two writers whose PUTs
and read-backs interleave exactly can still both pass on such a server; S3 honours the
condition.) A request whose answer was lost and that is tried again finds the lock object
holding its own token, and counts as taken.

The holder rewrites the object every ``lock_refresh_s`` (at most every quarter of
``lock_stale_s``; the period is recorded in the object) with a new heartbeat count (so its
ETag changes, also on stores whose ETag is the content's MD5), conditional on the ETag it last
wrote, and keeps the new ETag. The held lock's check reads the object and raises when it no
longer holds the holder's token (a Checkpointer checks before each save, so a holder whose lock
was taken stops saving). The release deletes the object only while it still holds the
holder's token, conditional on its current ETag.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

from ..errors import CheckpointError, CheckpointLockedError
from .base import HeldLock
from .holder import Holder, is_gone, is_restart_of, same_machine, this_holder
from .s3_client import S3Settings, call, error_code

log = logging.getLogger(__name__)

_REFUSED = ("PreconditionFailed", "ConditionalRequestConflict")
_MISSING = ("NoSuchKey", "NotFound", "404")  # "404": an error answer cut short
QUIET_PERIODS = 3
"""Refresh periods without a refresh after which a restart of the run takes the lock over."""


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
        self.period_s = _period_s(settings)

    @property
    def body(self) -> bytes:
        """The lock object's content: the holder, since when, its token and heartbeat."""
        info = {**self.holder.to_json(), "since": self.since, "token": self.token}
        return json.dumps({**info, "refresh_s": self.period_s, "beat": self._beats}).encode()

    def acquire(self) -> HeldLock:
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

        return HeldLock(release, self.check)

    def check(self) -> None:
        """Raise CheckpointLockedError unless the lock object still holds this holder's token
        (a read that fails raises its CheckpointError: it proves nothing either way)."""
        current = self._read()
        if current is not None and current[0].get("token") == self.token:
            return
        if current is None:
            now = "it was deleted"
        else:
            info = current[0]
            now = (
                f"{info.get('holder', 'another writer')} took it over (host "
                f"{info.get('host') or 'unknown'}, run id {info.get('run_id') or 'none'}, since "
                f"{info.get('since', 'an unknown time')})"
            )
        raise CheckpointLockedError(
            f"{self.where}: this writer ({self.holder.name}, run id "
            f"{self.holder.run_id or 'none'}) no longer holds the lock: {now}. Another job may "
            "be saving into the same place, and this one stops saving there rather than write "
            "beside it (or let its retention delete the other's checkpoints). Stop one of the "
            "jobs, or give it another path, and restart it."
        )

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
                if not self._may_take(info, old_etag, age_s):
                    continue  # it changed hands or went away while this writer waited
                etag = self._put(IfMatch=old_etag)
            if etag is not None:
                return self._confirm()
        raise CheckpointLockedError(
            f"{self.where} kept changing hands while this writer tried to take it; another "
            "job is saving into the same place. Stop it or choose another path."
        )

    def _may_take(self, info: dict[str, Any], etag: str, age_s: float) -> bool:
        """True when the holder recorded in ``info`` is dead (logged); False when the lock
        changed meanwhile (read it again); else refuse."""
        holder = Holder.from_json(info)
        if age_s >= self.settings.lock_stale_s:
            why = f"not refreshed for {age_s:.0f} s"
        elif is_gone(holder):
            why = f"its process {holder.pid} on this host is gone"
        elif is_restart_of(holder) and not same_machine(holder):
            quiet_s = QUIET_PERIODS * self._holder_period_s(info)
            if not self._silent(info, etag, age_s, quiet_s):
                return False
            why = (
                f"a restart of its run ({holder.run_id}): its heartbeat from "
                f"{holder.host or 'another host'} stopped for {quiet_s:.0f} s"
            )
        else:
            raise self._locked(info, age_s)
        log.warning("%s: taking over the lock of %s: %s", self.where, info.get("holder"), why)
        return True

    def _holder_period_s(self, info: dict[str, Any]) -> float:
        """The refresh period the holder recorded (a quarter of the stale time for a holder
        that records none), never longer than that."""
        period = info.get("refresh_s")
        fallback = self.settings.lock_stale_s / 4
        if not isinstance(period, int | float) or not math.isfinite(period) or period <= 0:
            return fallback
        return min(float(period), fallback)

    def _silent(self, info: dict[str, Any], etag: str, age_s: float, quiet_s: float) -> bool:
        """Wait until the lock (at ``etag``, ``age_s`` old) has gone ``quiet_s`` without a
        refresh: True then; False when it went away or another writer took it meanwhile;
        refuse when its holder refreshed it (alive)."""
        waited = time.monotonic()
        if age_s < quiet_s:
            log.warning(
                "%s is held by %s of this run (%s) on host %s, refreshed %.0f s ago: waiting "
                "until it has gone %.0f s without a refresh before taking it over (a holder "
                "that refreshes it meanwhile is alive, and this writer is refused)",
                self.where,
                info.get("holder"),
                info.get("run_id"),
                info.get("host") or "unknown",
                age_s,
                quiet_s,
            )
        poll_s = quiet_s / QUIET_PERIODS
        while age_s < quiet_s:
            time.sleep(max(0.2, min(poll_s, quiet_s - age_s)))
            current = self._read()
            if current is None:
                return False
            now, now_etag, age_s = current
            if now_etag != etag:
                if now.get("token") != info.get("token"):
                    return False
                raise self._alive(now, time.monotonic() - waited)
        return True

    def _alive(self, info: dict[str, Any], waited_s: float) -> CheckpointLockedError:
        return CheckpointLockedError(
            f"{self.where.rsplit('/', 1)[0]} is being written by "
            f"{info.get('holder', 'another writer')} (host {info.get('host') or 'unknown'}, "
            f"run id {info.get('run_id') or 'none'}; since {info.get('since', 'an unknown time')}"
            f"), a writer of this same run on another host, and alive: it refreshed the lock "
            f"while this writer ({self.holder.name}) waited {waited_s:.0f} s for its heartbeat "
            "to stop. Two writers must not save into one place, even of one run (the job steps "
            "of one SLURM allocation share SLURM_JOB_ID): stop the other one, or give each its "
            "own path or its own UNICKPT_RUN_ID."
        )

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
            "(UNICKPT_RUN_ID, or torchrun's TORCHELASTIC_RUN_ID, or SLURM_JOB_ID): the restart "
            "takes the lock once the holder's process is gone (on this host) or its heartbeat "
            f"has stopped for {QUIET_PERIODS} refresh periods (on another). A lock not "
            f"refreshed for {self.settings.lock_stale_s:.0f} s (UNICKPT_S3_LOCK_STALE_S) is "
            f"taken over; if its holder is surely gone, delete {self.where}."
        )

    def _refresh(self, stop: threading.Event) -> None:
        """Rewrite the lock object with the next heartbeat, conditional on the ETag last
        written, so that it stays fresh; keep the new ETag."""
        while not stop.wait(self.period_s):
            try:
                if not self._beat():
                    log.error(
                        "%s was taken over by another writer; this writer's next save fails",
                        self.where,
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


def _period_s(settings: S3Settings) -> float:
    """How often a holder refreshes its lock."""
    return min(settings.lock_refresh_s, settings.lock_stale_s / 4)
