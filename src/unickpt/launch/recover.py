"""``unickpt.recover(train)``: run the training function, and run it again in the same process
when another process of the job fails.

Under ``unickpt run`` every process (worker or spare) runs the script and calls
``recover(train)``, which asks the job's store (:mod:`.store`) what this process is in each
membership. A worker forms the default process group of the membership (gloo on CPU; on GPUs
one group with NCCL for CUDA tensors and gloo beside it for CPU ones) and calls ``train``; a
spare waits. When a worker of the membership dies, its launcher sets ``end/<epoch>``; a thread
of every process waits on that key, and a survivor inside ``train`` is interrupted at once:
its collective fails (the dead peer's connections close, and those of every survivor as it
leaves), and a survivor computing outside a collective gets
:class:`~unickpt.errors.MembershipChanged` raised in its main thread (by a signal, so a sleep
or a lock wait ends too). ``train`` unwinds; the process leaves the membership
(:mod:`.teardown`), says so, and waits for the next one, in which it keeps its rank while a
spare takes the dead one's; then ``train`` is called again. ``recover`` returns ``train``'s
value once it has returned on every rank.

Without ``unickpt run`` (plain ``python``, torchrun) it forms the process group from the
environment when none is formed and calls ``train`` once.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from ..config import get_config
from ..errors import MembershipChanged, RecoveryError
from .plan import Membership, slot_parts
from .procs import SLOT_ENV, STORE_ENV
from .store import JobStore
from .teardown import tear_down

log = logging.getLogger(__name__)
T = TypeVar("T")

INTERRUPT = signal.SIGUSR1  # how the watcher interrupts the main thread
TIMEOUT_ENV = "UNICKPT_RUN_TIMEOUT_S"
# Modules whose functions take the default process group of the moment they are imported as a
# default argument (``group=group.WORLD``): imported while a group exists, they keep it alive
# for the life of the process, and a group never destroyed never closes its connections, so a
# peer waiting on it hangs instead of failing. Imported before the first group forms.
_HOLD_DEFAULT_GROUP = (
    "torch.distributed.nn.functional",
    "torch.distributed.optim.zero_redundancy_optimizer",
    "torch.distributed.fsdp.sharded_grad_scaler",
)
# What a training function imports at its first Checkpointer (DTensor, DCP and FSDP under
# unickpt.api) and at its first optimizer (torch._dynamo, with inductor under it): seconds of
# CPU that a spare spends before it is needed, not while the survivors wait for it.
_WARM = ("unickpt.api", "unickpt.checkpointer", "unickpt.tiers.policy", "torch._dynamo")
# How long an error of ``train`` waits for a failure elsewhere to explain it (a collective
# fails before the dead process's launcher has said so) before it counts as this rank's own.
EXPLAIN_S = 10.0


@dataclass(frozen=True)
class Recovery:
    """How this process came into its membership after a failure, as Unix times: the failure
    announced (by the launcher that saw the process die; None when no process died, as when a
    membership did not form in time), seen here and left (the old groups torn down, the old
    saves ended: a survivor's; a replacement saw it only, a restarted process neither), and
    joined (the new process group formed)."""

    fault_at: float | None
    seen_at: float | None
    left_at: float | None
    joined_at: float
    failed_rank: int | None


@dataclass(frozen=True)
class Epoch:
    """The membership this process trains in: its number, this rank, the world, how this
    process came in (``"start"``, ``"survivor"``, ``"replacement"``, or ``"restart"``: a new
    process of a full restart), and the recovery that led here (None at the job's start)."""

    epoch: int
    rank: int
    world_size: int
    joined_as: str
    recovery: Recovery | None


_CURRENT: Epoch | None = None


def current_epoch() -> Epoch | None:
    """The membership this process trains in (None outside :func:`recover`'s ``train``)."""
    return _CURRENT


def recover(train: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``train(*args, **kwargs)`` with the default process group formed; under
    ``unickpt run``, call it again in this process after another process of the job failed.

    ``train`` builds whatever binds to the process group (DDP, FSDP, meshes, a
    :class:`~unickpt.Checkpointer`) and resumes with ``load_latest``: after a failure the
    survivors restore the newest committed step from their node's memory, the replacement
    from its node's memory or a peer's. Keep such objects inside ``train``: one made before
    belongs to a membership that ends at the first failure.

    >>> def train(steps):  # doctest: +SKIP
    ...     model = DDP(Net()); opt = torch.optim.Adam(model.parameters())
    ...     state = {"model": model, "optim": opt}
    ...     ckpt = unickpt.Checkpointer("ckpt", memory=unickpt.MemoryTier())
    ...     last = ckpt.load_latest(state)
    ...     for step in range(0 if last is None else last + 1, steps):
    ...         ...
    ...         ckpt.save(step, state)
    ...     ckpt.close()
    >>> if __name__ == "__main__":  # doctest: +SKIP
    ...     unickpt.recover(train, 1000)

    Run with ``unickpt run --nproc-per-node 4 --spares 1 train.py`` (docs/recovery.md). A
    spare never returns: it exits (status 0) once the job is done.
    """
    where, slot = os.environ.get(STORE_ENV), os.environ.get(SLOT_ENV)
    if where is None or slot is None:
        return _once(train, args, kwargs)
    if dist.is_available() and dist.is_initialized():
        raise RecoveryError(
            "the default process group is formed already; under unickpt run, recover forms "
            "it for each membership of the job. Remove the init_process_group call."
        )
    if threading.current_thread() is not threading.main_thread():
        raise RecoveryError("recover runs in the main thread (it interrupts it when a rank fails).")
    for name in (*_HOLD_DEFAULT_GROUP, *_WARM):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    host, port = where.rsplit(":", 1)
    timeout_s = float(os.environ.get(TIMEOUT_ENV, "120"))
    return _Process(JobStore(host, int(port)), slot, timeout_s).run(train, args, kwargs)


def _once(train: Callable[..., T], args: Any, kwargs: Any) -> T:
    """Outside ``unickpt run``: the process group from the environment (or a world of one)."""
    made = not dist.is_initialized()
    if made and "WORLD_SIZE" in os.environ:
        dist.init_process_group(_backend())
    elif made:
        store = dist.HashStore()
        dist.init_process_group(_backend(), store=store, rank=0, world_size=1)
    try:
        return train(*args, **kwargs)
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()


def _backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


class _Watcher:
    """A thread that waits for the end of one epoch (``end/<epoch>``) on a connection of its
    own, and calls ``on_fault`` when it ended by a failure."""

    def __init__(self, store: JobStore, epoch: int, on_fault: Callable[[], None]) -> None:
        self.verdict: dict[str, Any] | None = None
        self.seen_at = 0.0
        self._ended = threading.Event()
        self._on_fault = on_fault
        threading.Thread(
            target=self._run, args=(store, epoch), name="unickpt-watch", daemon=True
        ).start()

    def _run(self, store: JobStore, epoch: int) -> None:
        try:
            verdict = store.wait(f"end/{epoch}")
        except Exception as e:  # noqa: BLE001 - the store (the first node's launcher) is gone
            verdict = {"why": "lost", "error": str(e)}
        self.seen_at = time.time()
        self.verdict = verdict
        self._ended.set()
        if verdict["why"] != "finished":
            self._on_fault()

    def wait(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        self._ended.wait(timeout_s)
        return self.verdict


class _Process:
    """This process's way through the job's memberships."""

    def __init__(self, store: JobStore, slot: str, timeout_s: float) -> None:
        self.store, self.slot, self.timeout_s = store, slot, timeout_s
        self.gen, self.node, self.k = slot_parts(slot)
        self.trained = False
        self.first = -1  # the first epoch of this process's generation
        self.left: dict[str, Any] | None = None  # how it left the last membership
        self._armed = False
        self._main = threading.main_thread().ident

    def run(self, train: Callable[..., T], args: Any, kwargs: Any) -> T:
        self.store.put(f"recover/{self.slot}", os.getpid())
        epoch = self.first = int(self.store.wait(f"first/{self.gen}"))
        previous = signal.signal(INTERRUPT, self._interrupted)
        try:
            while True:
                m = Membership.from_json(self.store.wait(f"epoch/{epoch}"))
                if m.gen != self.gen:  # a full restart: the launcher stops this process
                    raise SystemExit(f"slot {self.slot}: the job restarted without this process")
                if self.slot in m.ranks:
                    ended, result = self._member(m, train, args, kwargs)
                    if ended:
                        return cast(T, result)
                elif self.store.wait(f"end/{epoch}")["why"] == "finished":
                    raise SystemExit(0)  # a spare the job did not need
                else:
                    self.left = {"seen_at": time.time()}
                epoch += 1
        finally:
            signal.signal(INTERRUPT, previous)

    def _interrupted(self, signum: int, frame: Any) -> None:
        if self._armed:
            self._armed = False
            raise MembershipChanged("another process of the job failed; training restarts")

    def _interrupt(self) -> None:
        if self._armed and self._main is not None:
            signal.pthread_kill(self._main, INTERRUPT)

    def _member(
        self, m: Membership, train: Callable[..., T], args: Any, kwargs: Any
    ) -> tuple[bool, T | None]:
        """Train in membership ``m``; whether the job ended (and ``train``'s value)."""
        global _CURRENT
        rank = m.ranks[self.slot]
        self._join(m, rank)
        _CURRENT = Epoch(m.epoch, rank, m.world_size, self._came_as(), self._recovery(m))
        self.trained, self.left = True, None
        watcher = _Watcher(self.store.client(), m.epoch, self._interrupt)
        result: T | None = None
        try:
            self._armed = True
            try:
                result = train(*args, **kwargs)
            finally:
                self._armed = False
            self.store.count(f"done/{m.epoch}", 1)
            verdict = watcher.wait()
        except MembershipChanged:
            verdict = watcher.wait()
        except Exception as e:  # raised again below unless a failure elsewhere explains it
            verdict = watcher.wait(EXPLAIN_S)
            if verdict is None or verdict["why"] != "fault":
                raise
            log.info("rank %d: %s: %s, after rank %s failed", rank, type(e).__name__, e, verdict)
        finally:
            _CURRENT = None
        assert verdict is not None
        if verdict["why"] == "finished":
            dist.destroy_process_group()
            return True, result
        if verdict["why"] != "fault":
            raise RecoveryError(f"slot {self.slot}: the job's store is gone ({verdict['error']})")
        result = None
        tear_down(self.timeout_s)
        self.left = {"fault_at": verdict["at"], "seen_at": watcher.seen_at, "left_at": time.time()}
        self.left["failed_rank"] = verdict.get("rank")
        self.store.put(f"left/{m.epoch}/{self.slot}", self.left)
        self.store.count(f"nleft/{m.epoch}", 1)
        return False, None

    def _join(self, m: Membership, rank: int) -> None:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(m.world_size),
            LOCAL_RANK=str(self.k),
            LOCAL_WORLD_SIZE=str(m.local_world(self.node)),
        )
        if torch.cuda.is_available():
            torch.cuda.set_device(self.k % torch.cuda.device_count())
        dist.init_process_group(
            _backend(),
            store=self.store.prefixed(f"pg/{m.epoch}/"),
            rank=rank,
            world_size=m.world_size,
            timeout=datetime.timedelta(seconds=get_config().collective_timeout_s),
        )
        self.store.count(f"joined/{m.epoch}", 1)

    def _came_as(self) -> str:
        if self.trained:
            return "survivor"
        if self.left:
            return "replacement"
        return "start" if self.gen == 0 else "restart"

    def _recovery(self, m: Membership) -> Recovery | None:
        """The recovery that led into ``m`` (None at the job's start)."""
        if m.epoch == 0:
            return None
        end = self.store.peek(f"end/{m.epoch - 1}") or {}
        left = self.left or {}
        return Recovery(
            fault_at=end.get("at"),
            seen_at=left.get("seen_at"),
            left_at=left.get("left_at"),
            joined_at=time.time(),
            failed_rank=end.get("rank"),
        )
