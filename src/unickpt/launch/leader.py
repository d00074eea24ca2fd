"""The leader: the first node's launcher decides every membership of the job.

It never waits: :meth:`Leader.tick` looks at the store and moves on, once per turn of the
launcher's loop. States, for the current epoch ``e``:

- **starting** generation ``g``: once every launcher has stopped its older processes
  (``stopped/<g>/<i>``), publish the first membership of ``g``; then *joining*;
- **joining**: once every rank of ``e`` formed the process group (``joined/<e>``), *running*.
  A rank of ``e`` that dies first, or a membership not formed within the timeout, is a failure
  during recovery: a full restart;
- **running**: ``end/<e>`` set by a launcher whose worker died: *gathering*. Every rank's
  function returned (``done/<e>``), or every worker exited 0 (a script without recover): the
  job is over;
- **gathering**: once every rank of ``e`` either left (``left/<e>/<slot>``) or died, publish
  ``e + 1``: the survivors keep their ranks, spares take the lost ones (:func:`.plan.replace`);
  then *joining*. No spare left (seen at the failure already when there is none at all), a
  survivor that does not run :func:`unickpt.recover`, or one that does not leave within the
  timeout: a full restart.

A full restart starts generation ``g + 1`` (every launcher stops its processes and starts new
ones: the memory tier restores them), at most ``max_restarts`` times; then the job fails.
Every fallback is logged with its reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from .plan import Membership, NodeSpec, first_membership, replace, slots, spares
from .store import JobStore

log = logging.getLogger(__name__)


class Leader:
    """The decisions of the job, taken in the first node's launcher."""

    def __init__(
        self, store: JobStore, nodes: Sequence[NodeSpec], max_restarts: int, timeout_s: float
    ) -> None:
        self.store, self.nodes = store, list(nodes)
        self.max_restarts, self.timeout_s = max_restarts, timeout_s
        self.gen, self.restarts = -1, 0
        self.m: Membership | None = None  # the newest published membership
        self.state = "starting"
        self.since = time.monotonic()
        self.fault_at = 0.0
        self.deaths = -1  # the launchers' count of exits, when last looked at
        self.code: int | None = None  # the job's exit status once it is over

    def begin(self) -> None:
        self._next_generation("the job starts")

    def tick(self) -> None:
        step = {
            "starting": self._starting,
            "joining": self._joining,
            "running": self._running,
            "gathering": self._gathering,
        }.get(self.state)
        if step is not None:
            step()

    # -- states ------------------------------------------------------------------------

    def _starting(self) -> None:
        if all(self.store.has(f"stopped/{self.gen}/{i}") for i in range(len(self.nodes))):
            epoch = 0 if self.m is None else self.m.epoch + 1
            self.store.put(f"first/{self.gen}", epoch)
            why = "start" if self.gen == 0 else "full restart"
            self._publish(first_membership(epoch, self.gen, self.nodes, why))
        elif self._late():
            self._fail(f"a launcher did not stop its processes within {self.timeout_s:.0f} s")

    def _joining(self) -> None:
        m = self._m()
        deaths = self.store.count("deaths")
        lost = []
        if deaths != self.deaths:  # a process died (maybe before it knew it was a member)
            self.deaths = deaths
            lost = [s for s in m.ranks if self.store.has(f"dead/{s}")]
        if lost:
            who = ", ".join(f"rank {m.ranks[s]} (slot {s})" for s in lost)
            self._restart(f"{who} died while epoch {m.epoch} formed (a failure during recovery)")
        elif self.store.count(f"joined/{m.epoch}") >= m.world_size:
            self.state = "running"
            if m.why != "start":
                log.warning(
                    "epoch %d formed: %d ranks training again %.2f s after the failure",
                    m.epoch,
                    m.world_size,
                    time.time() - self.fault_at,
                )
        elif self._late():
            self._restart(f"epoch {m.epoch} did not form within {self.timeout_s:.0f} s")

    def _running(self) -> None:
        m = self._m()
        end = self.store.peek(f"end/{m.epoch}")
        if end is None:
            done = self.store.count(f"done/{m.epoch}") >= m.world_size
            if done or self.store.count(f"exit0/{m.epoch}") >= m.world_size:
                end = self.store.first(f"end/{m.epoch}", {"why": "finished", "at": time.time()})
        if end is None:
            return
        if end["why"] == "finished":
            self._over(0, f"every rank finished in epoch {m.epoch}")
            return
        self.state, self.since, self.fault_at = "gathering", time.monotonic(), float(end["at"])
        log.warning(
            "epoch %d: rank %s (slot %s) failed with status %s; every node told",
            m.epoch,
            end.get("rank"),
            end.get("slot"),
            end.get("code"),
        )
        dead = [s for s in slots(m.gen, self.nodes) if self.store.has(f"dead/{s}")]
        if not spares(m, self.nodes, dead):  # nothing to wait for: restart at once
            self._restart(str(replace(m, [end["slot"]], [], "")))

    def _gathering(self) -> None:
        m = self._m()
        heard = self.store.count(f"nleft/{m.epoch}") + self.store.count(f"ndead/{m.epoch}")
        if heard < m.world_size and not self._late():
            return  # counters first: a look at every rank's keys once all may be in
        lost, waiting = [], []
        for s in m.ranks:
            if self.store.has(f"dead/{s}"):
                lost.append(s)
            elif not self.store.has(f"recover/{s}"):
                self._restart(f"rank {m.ranks[s]} does not run unickpt.recover(train)")
                return
            elif not self.store.has(f"left/{m.epoch}/{s}"):
                waiting.append(s)
        if waiting:
            if self._late():
                ranks = ", ".join(str(m.ranks[s]) for s in waiting)
                self._restart(
                    f"rank(s) {ranks} did not leave their training function within "
                    f"{self.timeout_s:.0f} s"
                )
            return
        dead = [s for s in slots(m.gen, self.nodes) if self.store.has(f"dead/{s}")]
        alive = spares(m, self.nodes, dead)
        lost_ranks = ", ".join(str(m.ranks[s]) for s in lost)
        nxt = replace(m, lost, alive, f"rank(s) {lost_ranks} lost")
        if isinstance(nxt, str):
            self._restart(nxt)
            return
        moved = ", ".join(f"rank {nxt.ranks[s]} -> slot {s}" for s in nxt.ranks if s not in m.ranks)
        log.warning("epoch %d: %s (%d spare(s) left)", nxt.epoch, moved, len(alive) - len(lost))
        self._publish(nxt)

    # -- transitions -------------------------------------------------------------------

    def _publish(self, m: Membership) -> None:
        self.store.put(f"epoch/{m.epoch}", m.to_json())
        self.store.put("current", m.epoch)
        self.m, self.state, self.since = m, "joining", time.monotonic()

    def _restart(self, why: str) -> None:
        self.restarts += 1
        if self.restarts > self.max_restarts:
            self._fail(f"{why}; the job was restarted in full {self.max_restarts} time(s) already")
            return
        log.warning("full restart %d of at most %d: %s", self.restarts, self.max_restarts, why)
        self._next_generation(why)

    def _next_generation(self, why: str) -> None:
        self.gen += 1
        self.store.put("gen", {"gen": self.gen, "why": why})
        self.state, self.since = "starting", time.monotonic()

    def _fail(self, why: str) -> None:
        log.error("the job fails: %s", why)
        self.store.put("gen", {"gen": -1, "why": why})
        self._over(1, why)

    def _over(self, code: int, why: str) -> None:
        self.store.put("over", {"code": code, "why": why})
        self.state, self.code = "over", code

    def _m(self) -> Membership:
        assert self.m is not None
        return self.m

    def _late(self) -> bool:
        return time.monotonic() - self.since > self.timeout_s
