"""A node's processes: started with torchrun's environment, watched, stopped.

Each process runs the script in a fresh interpreter and a session of its own (so a stop
reaches its children too). Its environment is torchrun's (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``GROUP_RANK``,
``TORCHELASTIC_USE_AGENT_STORE`` so that a plain ``init_process_group()`` meets through the
launcher's store) plus ``UNICKPT_NODE`` and where :func:`unickpt.recover` finds the job
(``UNICKPT_RUN_STORE``, ``UNICKPT_RUN_SLOT``). A spare has no ``RANK`` until recover gives it
one. An exit is seen at once through a pidfd where the system has them (Linux), else by
polling.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .plan import NodeSpec, slot_name

log = logging.getLogger(__name__)

STORE_ENV = "UNICKPT_RUN_STORE"
SLOT_ENV = "UNICKPT_RUN_SLOT"


@dataclass(frozen=True)
class Exit:
    """A process that ended: its slot, pid and status (``-N``: killed by signal ``N``)."""

    slot: str
    pid: int
    code: int


@dataclass(frozen=True)
class Job:
    """What every process of the job shares: the command, the store, the world."""

    argv: tuple[str, ...]
    master_addr: str
    master_port: int
    world_size: int


class NodeProcesses:
    """The processes of node ``index`` in the current generation."""

    def __init__(self, job: Job, index: int, spec: NodeSpec, rank_offset: int) -> None:
        self.job, self.index, self.spec, self.rank_offset = job, index, spec, rank_offset
        self.gen = -1
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._fds: dict[int, str] = {}

    @property
    def alive(self) -> list[str]:
        return list(self._procs)

    def pid(self, slot: str) -> int | None:
        proc = self._procs.get(slot)
        return None if proc is None else proc.pid

    def start(self, gen: int) -> None:
        """Start generation ``gen``: ``nproc`` workers, then the spares."""
        self.gen = gen
        for k in range(self.spec.nproc + self.spec.spares):
            slot = slot_name(gen, self.index, k)
            proc = subprocess.Popen(
                list(self.job.argv), env=self._environment(slot, k), start_new_session=True
            )
            self._procs[slot] = proc
            if hasattr(os, "pidfd_open"):
                self._fds[os.pidfd_open(proc.pid)] = slot
            role = f"rank {self.rank_offset + k}" if k < self.spec.nproc else "spare"
            log.info("node %d: started slot %s (%s), pid %d", self.index, slot, role, proc.pid)

    def _environment(self, slot: str, k: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=self.job.master_addr,
            MASTER_PORT=str(self.job.master_port),
            WORLD_SIZE=str(self.job.world_size),
            LOCAL_RANK=str(k),
            LOCAL_WORLD_SIZE=str(self.spec.nproc),
            GROUP_RANK=str(self.index),
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RESTART_COUNT=str(self.gen),
            UNICKPT_NODE=self.spec.name,
            **{STORE_ENV: f"{self.job.master_addr}:{self.job.master_port}", SLOT_ENV: slot},
        )
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: processes share the node's cores
        if k < self.spec.nproc:
            env["RANK"] = str(self.rank_offset + k)
        else:
            env.pop("RANK", None)
        return env

    def exited(self, timeout_s: float) -> list[Exit]:
        """The processes that ended, waiting up to ``timeout_s`` for one."""
        if self._fds:
            with contextlib.suppress(InterruptedError):
                select.select(list(self._fds), [], [], timeout_s)
        elif timeout_s > 0:
            time.sleep(timeout_s)
        gone = []
        for slot, proc in list(self._procs.items()):
            code = proc.poll()
            if code is not None:
                gone.append(Exit(slot, proc.pid, code))
                self._forget(slot)
        return gone

    def _forget(self, slot: str) -> None:
        del self._procs[slot]
        for fd, s in list(self._fds.items()):
            if s == slot:
                os.close(fd)
                del self._fds[fd]

    def stop(self, grace_s: float, slots: Sequence[str] | None = None) -> list[Exit]:
        """SIGTERM to the processes (``slots``, default all) and theirs; SIGKILL to those left
        after ``grace_s``. Returns their exits."""
        chosen = [s for s in (self.alive if slots is None else slots) if s in self._procs]
        for s in chosen:
            _signal_group(self._procs[s].pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        gone: list[Exit] = []
        while chosen:
            for e in self.exited(min(0.05, max(0.0, deadline - time.monotonic()))):
                gone.append(e)
                if e.slot in chosen:
                    chosen.remove(e.slot)
            if chosen and time.monotonic() >= deadline:
                for s in chosen:
                    _signal_group(self._procs[s].pid, signal.SIGKILL)
                deadline = float("inf")
        return gone


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
