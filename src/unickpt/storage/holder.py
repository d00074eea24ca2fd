"""Who holds a writer lock: the process, its host, and the run it belongs to.

A lock that cannot be released by the kernel when its holder dies (an object in a bucket)
records its holder, so that the next writer can tell a live holder from a dead one:

- the **run id** names a training run across restarts: ``UNICKPT_RUN_ID`` if set, else
  torchrun's ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``; its default ``none`` counts as no id),
  else SLURM's ``SLURM_JOB_ID`` (the same across the job's requeues: ``SLURM_RESTART_COUNT``
  is no part of it), else none. A restart of the same run takes over its lock once the
  holder's process is gone (on this host) or its heartbeat has stopped (on another host);
- the **process** (host, pid namespace, pid and start time): a holder on this host whose
  process is gone is dead, whatever its run; a pid reused by another process does not count
  as the holder, its start time differs.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUN_ID_VARIABLES = ("UNICKPT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


@dataclass(frozen=True)
class Holder:
    """A lock holder as recorded in its lock."""

    host: str
    pid: int | None
    started: str | None
    """The process's start time (``/proc/<pid>/stat``), to tell a reused pid; None unknown."""
    pid_namespace: str | None
    run_id: str | None
    """``VARIABLE=value`` of the run id (see the module's docstring), None without one."""

    @property
    def name(self) -> str:
        who = f"pid {self.pid}" if self.pid is not None else "a writer"
        return f"{who} on {self.host}"

    def to_json(self) -> dict[str, Any]:
        return {
            "holder": self.name,
            "host": self.host,
            "pid": self.pid,
            "started": self.started,
            "pid_namespace": self.pid_namespace,
            "run_id": self.run_id,
        }

    @staticmethod
    def from_json(info: dict[str, Any]) -> Holder:
        """The holder a lock records; fields it lacks (older or foreign locks) unknown."""
        pid = info.get("pid")
        return Holder(
            host=str(info.get("host") or ""),
            pid=pid if isinstance(pid, int) else None,
            started=_text(info.get("started")),
            pid_namespace=_text(info.get("pid_namespace")),
            run_id=_text(info.get("run_id")),
        )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def run_id() -> str | None:
    """This process's run id as ``VARIABLE=value``, or None."""
    for variable in RUN_ID_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value and value.lower() != "none":
            return f"{variable}={value}"
    return None


def this_holder() -> Holder:
    pid = os.getpid()
    return Holder(socket.gethostname(), pid, _start_time(pid), _pid_namespace(), run_id())


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot; None when it is gone or
    unknown (no ``/proc``)."""
    fields = _stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rpartition(")")[2].split()


def is_gone(holder: Holder) -> bool:
    """Whether ``holder`` is a process of this host (and pid namespace) that no longer runs.
    False when that cannot be known: another host, or a lock that records no process."""
    if holder.pid is None or not same_machine(holder):
        return False
    if not Path("/proc/self/stat").exists():  # no /proc: ask the kernel whether the pid is used
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    fields = _stat(holder.pid)
    if fields is None or fields[0] in ("Z", "X"):  # no such process, or a zombie
        return True
    return holder.started is not None and fields[19:20] != [holder.started]


def same_machine(holder: Holder) -> bool:
    """Whether ``holder`` ran on this host, in this pid namespace (so its process can be
    looked up here)."""
    me = this_holder()
    return holder.host == me.host and holder.pid_namespace == me.pid_namespace


def is_restart_of(holder: Holder) -> bool:
    """Whether this process belongs to ``holder``'s run (both have the same run id)."""
    mine = run_id()
    return mine is not None and holder.run_id == mine
