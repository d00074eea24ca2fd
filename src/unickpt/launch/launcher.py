"""One node's launcher (``unickpt run``): start the node's processes, say when one dies, and on
the first node, host the job's store and decide (:mod:`.leader`).

Who tells whom, in order, when a worker dies:

1. its launcher sees the exit at once (a pidfd), writes ``dead/<slot>`` and sets
   ``end/<epoch>`` to ``fault``: every process of every node waits on that key, so all learn
   it at once, without a collective timing out;
2. each survivor's training function is interrupted and unwinds; the survivor tears down its
   groups, ends its background saves and writes ``left/<epoch>/<slot>``;
3. the leader, once every rank left or died, publishes the next membership (spares in the
   lost ranks' places); the survivors and the chosen spares form its process group and call
   the training function again;
4. a failure the spares cannot cover, or one during steps 2-3: the leader starts the next
   generation, every launcher stops all its processes and starts new ones (a full restart).

The launcher ends when the job is over: 0 when every worker finished, 1 otherwise (a SIGTERM or
SIGINT to any launcher ends the job).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from ..errors import RecoveryError
from .leader import Leader
from .plan import Membership, NodeSpec, slot_parts
from .procs import Exit, Job, NodeProcesses
from .recover import TIMEOUT_ENV
from .store import JobStore

log = logging.getLogger(__name__)

TICK_S = 0.02  # how long a turn of the loop waits for a process to exit


@dataclass(frozen=True)
class RunOptions:
    """``unickpt run``'s options."""

    argv: tuple[str, ...]
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    spares: int = 0
    node_name: str = ""
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    max_restarts: int = 3
    recovery_timeout_s: float = 120.0
    stop_timeout_s: float = 30.0


def run(opts: RunOptions) -> int:
    """Run this node's part of the job; the launcher's exit status."""
    os.environ[TIMEOUT_ENV] = str(opts.recovery_timeout_s)
    leading = opts.node_rank == 0
    store = JobStore(opts.master_addr, opts.master_port, server=leading, timeout_s=300.0)
    spec = NodeSpec(opts.node_name, opts.nproc_per_node, opts.spares)
    store.put(f"node/{opts.node_rank}", spec.__dict__)
    nodes = [NodeSpec(**store.wait(f"node/{i}", 300.0)) for i in range(opts.nnodes)]
    _check(nodes)
    world = sum(n.nproc for n in nodes)
    offset = sum(n.nproc for n in nodes[: opts.node_rank])
    job = Job(opts.argv, opts.master_addr, opts.master_port, world)
    node = _Node(store, NodeProcesses(job, opts.node_rank, spec, offset), opts)
    leader = Leader(store, nodes, opts.max_restarts, opts.recovery_timeout_s) if leading else None
    if leader is not None:
        leader.begin()
    return node.loop(leader, opts.nnodes)


def _check(nodes: list[NodeSpec]) -> None:
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise RecoveryError(
            f"the nodes are named {names}: two launchers share a name. Give each node its own "
            "(--node-name, or the host name when it is not given)."
        )


class _Node:
    """The loop of one launcher."""

    def __init__(self, store: JobStore, procs: NodeProcesses, opts: RunOptions) -> None:
        self.store, self.procs, self.opts = store, procs, opts
        self.index = opts.node_rank
        self.failed = False  # a worker of this node exited with an error once the job was over
        self.signalled: int | None = None
        self._epochs: dict[int, Membership] = {}

    def loop(self, leader: Leader | None, nnodes: int) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            code = self._turns(leader)
        except (RuntimeError, RecoveryError) as e:  # the store, hosted by the first node, is gone
            log.error("node %d: lost the job's store (%s); stopping", self.index, e)
            self.procs.stop(self.opts.stop_timeout_s)
            return 1
        if leader is not None:  # keep the store up until every launcher is done with it
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:
                if all(self.store.has(f"exited/{i}") for i in range(nnodes)):
                    break
                time.sleep(0.05)
        return code

    def _turns(self, leader: Leader | None) -> int:
        while True:
            for e in self.procs.exited(TICK_S):
                self._on_exit(e)
            if self.signalled is not None:
                why = f"node {self.index}'s launcher got signal {self.signalled}"
                self.store.put("gen", {"gen": -1, "why": why})
                self.store.put("over", {"code": 1, "why": why})
            gen = self.store.peek("gen")
            if gen is not None and gen["gen"] == -1:
                self.procs.stop(self.opts.stop_timeout_s)
                self.store.put(f"exited/{self.index}", 1)
                return 1
            if gen is not None and gen["gen"] > self.procs.gen:
                self._restart(int(gen["gen"]), gen["why"])
            if leader is not None:
                leader.tick()
            over = self.store.peek("over")
            if over is not None and not self.procs.alive:
                self.store.put(f"exited/{self.index}", 1)
                return 1 if over["code"] or self.failed else 0

    def _restart(self, gen: int, why: str) -> None:
        if self.procs.alive:
            log.warning("node %d: stopping its processes for a full restart (%s)", self.index, why)
            self.procs.stop(self.opts.stop_timeout_s)
        self.store.put(f"stopped/{gen}/{self.index}", 1)
        self.procs.start(gen)

    def _on_exit(self, e: Exit) -> None:
        if slot_parts(e.slot)[0] != self.procs.gen:
            return  # a process of an older generation, stopped for a full restart
        self.store.put(f"dead/{e.slot}", {"code": e.code, "pid": e.pid})
        self.store.count("deaths", 1)
        if self.store.has("over"):
            self.failed = self.failed or e.code != 0
            return
        m = self._membership()
        if m is None or e.slot not in m.ranks:
            if e.code != 0:
                log.warning(
                    "node %d: spare slot %s (pid %d) exited with %d",
                    self.index,
                    e.slot,
                    e.pid,
                    e.code,
                )
            return
        if e.code == 0 and not self.store.has(f"recover/{e.slot}"):
            self.store.count(f"exit0/{m.epoch}", 1)  # a script without recover finished
            return
        self.store.count(f"ndead/{m.epoch}", 1)
        fault = {"why": "fault", "slot": e.slot, "rank": m.ranks[e.slot], "code": e.code}
        self.store.first(f"end/{m.epoch}", {**fault, "pid": e.pid, "at": time.time()})
        log.warning(
            "node %d: rank %d (slot %s, pid %d) exited with %d",
            self.index,
            m.ranks[e.slot],
            e.slot,
            e.pid,
            e.code,
        )

    def _membership(self) -> Membership | None:
        current = self.store.peek("current")
        if current is None:
            return None
        epoch = int(current)
        if epoch not in self._epochs:
            self._epochs[epoch] = Membership.from_json(self.store.wait(f"epoch/{epoch}", 60.0))
        return self._epochs[epoch]

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = signum
