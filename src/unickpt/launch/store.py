"""The job's store: one TCPStore on the first node, shared by the launchers and the processes.

Every agreement of ``unickpt run`` goes through it (its keys below; values are JSON): the
launchers register their nodes, the first node's launcher (the leader) publishes each
membership, the launcher of a process that died says so to every node at once, the processes
leave and join epochs, and each membership's process group meets under a prefix of its own.

==========================  ========================================================
key                         written by, meaning
==========================  ========================================================
``node/<i>``                launcher ``i``: its node (name, processes, spares)
``gen``                     leader: the generation of processes (a full restart starts the
                            next; ``-1`` ends the job)
``stopped/<g>/<i>``         launcher ``i``: none of its processes is older than generation g
``epoch/<e>``, ``current``  leader: membership ``e`` (slot -> rank), the newest published
``end/<e>``                 first writer wins: ``fault`` (a launcher whose worker died) or
                            ``finished`` (the leader, once every rank's function returned)
``dead/<slot>``, ``deaths``  the slot's launcher: the process exited (its status); how many
                            processes of the job exited
``recover/<slot>``          the process: it runs :func:`unickpt.recover`
``left/<e>/<slot>``         a survivor: it left epoch ``e`` (groups torn down, work ended)
``nleft/<e>``, ``ndead/<e>``  counters: ranks of ``e`` that left; that died (the leader
                            looks at each rank's keys once they add up)
``joined/<e>``, ``done/<e>``  counters: ranks whose process group of ``e`` formed; whose
                            training function returned
``exit0/<e>``               counter: workers of ``e`` that exited with status 0
``over``, ``exited/<i>``    leader: the job ended; launcher ``i``: its processes are gone
``pg/<e>/...``              the process group of membership ``e`` (gloo's rendezvous)
==========================  ========================================================
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch.distributed as dist

from ..errors import RecoveryError

# Waits that end only when the key is set (by the leader, or a launcher) use this bound.
FOREVER_S = 7 * 24 * 3600.0


class JobStore:
    """A connection to the job's TCPStore (``server=True`` on the first node's launcher, which
    hosts it). One connection per thread: a wait holds its connection until the key is set."""

    def __init__(self, host: str, port: int, server: bool = False, timeout_s: float = 300.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        try:
            self.raw = dist.TCPStore(
                host,
                port,
                is_master=server,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except (RuntimeError, OSError) as e:
            what = "start the job's store on" if server else "reach the job's store at"
            raise RecoveryError(
                f"could not {what} {host}:{port} ({e}); expected the first node's launcher "
                "there (--master-addr, --master-port), the port free on that node."
            ) from e

    def client(self) -> JobStore:
        """Another connection to the same store (for another thread)."""
        return JobStore(self.host, self.port, False, self.timeout_s)

    def put(self, key: str, value: Any) -> None:
        self.raw.set(key, json.dumps(value))

    def peek(self, key: str) -> Any:
        """The key's value, or None when it is not set (never waits)."""
        if not self.raw.check([key]):
            return None
        return json.loads(self.raw.get(key))

    def has(self, key: str) -> bool:
        return bool(self.raw.check([key]))

    def wait(self, key: str, timeout_s: float = FOREVER_S) -> Any:
        """The key's value once it is set; raises :class:`RecoveryError` past ``timeout_s``."""
        try:
            self.raw.wait([key], datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise RecoveryError(
                f"waited {timeout_s:.0f} s for {key!r} in the job's store at "
                f"{self.host}:{self.port} ({e}); the leader (the first node's launcher) "
                "did not decide: look at its log."
            ) from e
        return json.loads(self.raw.get(key))

    def first(self, key: str, value: Any) -> Any:
        """Set ``key`` unless it is set; the value it holds then (the first writer's)."""
        return json.loads(self.raw.compare_set(key, "", json.dumps(value)))

    def count(self, key: str, add: int = 0) -> int:
        return int(self.raw.add(key, add))

    def prefixed(self, prefix: str) -> Any:
        """A store for a process group: this connection, under ``prefix``."""
        return dist.PrefixStore(prefix, self.raw)
