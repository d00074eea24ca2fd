"""Collectives over a dedicated gloo group, and errors from all ranks raised once everywhere."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import pickle
import socket
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from . import errors as E

log = logging.getLogger(__name__)
T = TypeVar("T")
L = TypeVar("L")
S = TypeVar("S")

_GROUPS: dict[tuple[int, ...], OwnGroup] = {}  # the groups of Comm, by global ranks
_OWNED: list[OwnGroup] = []  # every live group unickpt made, released at interpreter exit
_GROUPS_LOCK = threading.Lock()
_MAKING = threading.RLock()  # groups are made (a collective) by one thread at a time
_GENERATION = 0  # how many times this process's job changed its membership (reset_groups)
_ON_RESET: list[Callable[[], None]] = []  # caches of a membership, cleared by reset_groups
_RELEASED = (
    "unickpt's process groups were released (at interpreter exit, or by "
    "unickpt.dist.release_groups()); save and load before the interpreter exits."
)
_CHANGED = (
    "the job's membership changed (a process failed and unickpt.recover re-formed the process "
    "groups without it): this save, load or Checkpointer belongs to the old membership. Make "
    "the Checkpointer again inside the training function that recover calls."
)
_DESTROYED = (
    "the process group this save, load or Checkpointer was made with was destroyed by "
    "torch.distributed.destroy_process_group(); after a new init_process_group, make a new "
    "Checkpointer (unickpt.save and unickpt.load make new groups by themselves)."
)


class OwnGroup:
    """A gloo process group unickpt made for its own collectives, never the training's.

    All of them are destroyed by :func:`release_groups` at interpreter exit, while the
    interpreter is still whole: a gloo group still alive when the interpreter finalizes can
    abort the process, since its worker thread may release the tensors of the last collective
    it ran (which takes the interpreter lock) after finalization began, and a thread taking
    the lock then is stopped inside torch's C++ code ("terminate called without an active
    exception", SIGABRT). A group that ``destroy_process_group()`` destroyed is let go when the
    next one is made, and using it raises (the Comm of a save or load makes a new one).
    """

    def __init__(self, ranks: Sequence[int], timeout_s: float) -> None:
        """Collective over ``ranks`` (global ranks), like ``new_group``."""
        self._why = ""
        with _MAKING:
            try:
                self._pg: Any = dist.new_group(
                    ranks=list(ranks),
                    backend="gloo",
                    timeout=datetime.timedelta(seconds=timeout_s),
                    use_local_synchronization=len(ranks) != dist.get_world_size(),
                )
            except RuntimeError as e:
                raise E.DistributedCheckpointError(
                    f"making unickpt's process group of ranks {_span(list(ranks))} failed ({e}): "
                    "a rank died, hung past the collective timeout "
                    f"({timeout_s:.0f} s, UNICKPT_COLLECTIVE_TIMEOUT_S) or called the save or "
                    "load alone; every rank of the group calls it together. Look at the other "
                    "ranks' logs. Committed checkpoints are untouched.",
                    {},
                ) from e
            with _GROUPS_LOCK:
                dead = [g for g in _OWNED if not g.alive]
                _OWNED[:] = [g for g in _OWNED if g not in dead] + [self]
        for group in dead:  # torch destroyed them: drop the last references here and now
            group._pg, group._why = None, _DESTROYED

    @property
    def pg(self) -> Any:
        if self._pg is None:
            raise E.DistributedCheckpointError(self._why or _RELEASED, {})
        if not _registered(self._pg):
            raise E.DistributedCheckpointError(_DESTROYED, {})
        return self._pg

    @property
    def alive(self) -> bool:
        """Not released, and still known to torch (``destroy_process_group()`` forgets it)."""
        return self._pg is not None and _registered(self._pg)

    def forget(self) -> Any:
        """Let go of the group without destroying it (every later use raises); torch's group
        object, for the caller to drop where its destruction may wait (see
        :func:`reset_groups`)."""
        pg, self._pg, self._why = self._pg, None, _CHANGED
        return pg

    def release(self) -> None:
        """Destroy the group (unless torch already did); every later use raises."""
        pg, self._pg, self._why = self._pg, None, _RELEASED
        if pg is not None and _registered(pg):
            dist.destroy_process_group(pg)


def _registered(pg: Any) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_process_group_ranks(pg)
    except (ValueError, KeyError, RuntimeError):
        return False
    return True


def release_groups() -> None:
    """Destroy every process group unickpt made (run at interpreter exit; see
    :class:`OwnGroup`). Saves and loads made afterwards make new ones."""
    with _GROUPS_LOCK:
        owned = list(_OWNED)
        _OWNED.clear()
        _GROUPS.clear()
    for group in owned:
        try:
            group.release()
        except Exception as e:  # noqa: BLE001 - the process is ending: say so, release the rest
            log.warning("releasing a process group of unickpt at exit failed: %s", e)


atexit.register(release_groups)


def node_name() -> str:
    """The node this process runs on: ``UNICKPT_NODE``, else the host name. The one notion of
    a node (docs/architecture.md, "Nodes"): the memory tier places replicas by it, and ranks
    of one node share reads through the host; ranks of different nodes, over the group."""
    return os.environ.get("UNICKPT_NODE") or socket.gethostname()


def machine_id() -> str | None:
    """This machine's boot id (None if unreadable): ranks that share memory must be on one
    machine, whatever their node names say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def reset_groups() -> list[Any]:
    """Forget every process group unickpt made, and every cache of the job's membership, after
    the membership changed (a process died, and the survivors form new groups without it in
    the same processes: :func:`unickpt.recover`). Returns torch's group objects, not destroyed:
    a gloo group's destruction waits for its collectives in flight, which end only once the
    peers' groups are gone too, so the caller drops them where waiting is harmless. Every later
    use of an old group (a Checkpointer, a pending save's thread) raises. Bumps
    :func:`generation`."""
    global _GENERATION
    with _GROUPS_LOCK:  # not _MAKING: a thread making a group of the old membership may hang
        owned = list(_OWNED)
        _OWNED.clear()
        _GROUPS.clear()
        _GENERATION += 1
    dropped = [group.forget() for group in owned]
    for hook in list(_ON_RESET):
        hook()
    return [pg for pg in dropped if pg is not None]


def on_reset(hook: Callable[[], None]) -> None:
    """Run ``hook`` at every :func:`reset_groups`: a process-wide cache made for one membership
    of the job clears itself there."""
    _ON_RESET.append(hook)


def generation() -> int:
    """How many times this process's job changed its membership (:func:`reset_groups`): what
    a process held for an older generation (the root's lock) it may take over."""
    return _GENERATION


@dataclass(frozen=True)
class RankFailure:
    """What one rank reports when its part of a step failed."""

    rank: int
    kind: str
    message: str
    trace: str


class Comm:
    """The ranks taking part in one save or load. A single process is a world of one."""

    def __init__(self, group: Any = None, timeout_s: float = 1800.0) -> None:
        self._group: OwnGroup | None = None
        self._timeout_s = timeout_s
        if dist.is_available() and dist.is_initialized():
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            self.rank = dist.get_rank(group) if group is not None else dist.get_rank()
            self.world_size = len(ranks)
            self._global_ranks = ranks
            if self.world_size > 1:
                self._group = _gloo_group(ranks, timeout_s)
        else:
            self.rank, self.world_size, self._global_ranks = 0, 1, (0,)

    @property
    def _pg(self) -> Any:
        """The gloo group, None for a single process; raises once released."""
        return None if self._group is None else self._group.pg

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: T) -> list[T]:
        if self._pg is None:
            return [obj]
        frame = _pickled(obj)
        with self._peers_lost("all_gather"):
            frames = _all_gather_bytes(frame, self._pg, self.world_size)
        return [_unpickled(f) for f in frames]

    def gather(self, obj: T) -> list[T] | None:
        """Objects of all ranks on the coordinator (rank 0 of the group); None elsewhere. The
        coordinator's own object is not sent (it keeps it), so the others' need not be padded
        to its size."""
        if self._pg is None:
            return [obj]
        frame = _pickled(None if self.is_coordinator else obj)
        dst = self._global_ranks[0]
        with self._peers_lost("gather"):
            frames = _gather_bytes(frame, self._pg, dst, self.is_coordinator)
        if frames is None:
            return None
        return [obj if r == self.rank else _unpickled(f) for r, f in enumerate(frames)]

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` (the coordinator's by default) on every rank."""
        if self._pg is None:
            return obj
        frame = _pickled(obj) if self.rank == src else None
        with self._peers_lost("broadcast"):
            got = _broadcast_bytes(frame, self._pg, self._global_ranks[src])
        return obj if frame is not None else _unpickled(got)  # type: ignore[no-any-return]

    def max_across(self, values: np.ndarray) -> np.ndarray:
        """The element-wise maximum of ``values`` (same shape on every rank) over all ranks."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def sum_across(self, values: np.ndarray) -> np.ndarray:
        """The element-wise sum of ``values`` (same shape on every rank) over all ranks."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def _reduce(self, values: np.ndarray, op: Any) -> np.ndarray:
        if self._pg is None or values.size == 0:
            return values
        t = torch.from_numpy(np.ascontiguousarray(values))
        with self._peers_lost("all_reduce"):
            dist.all_reduce(t, op=op, group=self._pg)
        _count(t.nbytes, t.nbytes)
        return t.numpy()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending the CPU tensor ``tensor`` to rank ``dst`` of the group (received by
        an :meth:`irecv` with the same ``tag``); finish it with :meth:`wait`."""
        with self._peers_lost("send"):
            work = dist.isend(tensor, self._global_ranks[dst], group=self._pg, tag=tag)
        _count(tensor.nbytes, 0, collective=False)
        return work

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        """Start receiving into the CPU tensor ``tensor`` what rank ``src`` of the group sends
        with ``tag``; finish it with :meth:`wait`."""
        with self._peers_lost("receive"):
            work = dist.irecv(tensor, self._global_ranks[src], group=self._pg, tag=tag)
        _count(0, tensor.nbytes, collective=False)
        return work

    def wait(self, work: Any, what: str) -> None:
        """Wait for a send or receive started by :meth:`isend` or :meth:`irecv`."""
        with self._peers_lost(what):
            work.wait()

    def barrier(self) -> None:
        if self._pg is not None:
            with self._peers_lost("barrier"):
                dist.barrier(group=self._pg)
            _count(0, 0)

    @contextlib.contextmanager
    def _peers_lost(self, what: str) -> Iterator[None]:
        """Turn a collective's failure (a dead, hung or diverging rank) into our error."""
        try:
            yield
        except RuntimeError as e:
            others = [r for r in range(self.world_size) if r != self.rank]
            named = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {_span(others)}"
            raise E.DistributedCheckpointError(
                f"rank {self.rank}: the {what} among the {self.world_size} ranks of this "
                f"checkpoint failed ({e}): {named} died, hung past the collective timeout "
                f"({self._timeout_s:.0f} s, UNICKPT_COLLECTIVE_TIMEOUT_S) or raised outside "
                "unickpt: look at the other ranks' logs. Committed checkpoints are untouched.",
                {},
            ) from e


@dataclass(frozen=True)
class Traffic:
    """The collectives of :class:`Comm` this process took part in, and the bytes it sent into
    them and received from the other ranks (payloads as exchanged: an object's pickle, padded
    to the longest of the ranks where all of them travel at one size; sizes included), sends
    and receives between two ranks counted in the bytes."""

    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def __sub__(self, before: Traffic) -> Traffic:
        return Traffic(
            self.collectives - before.collectives,
            self.bytes_sent - before.bytes_sent,
            self.bytes_received - before.bytes_received,
        )


_TRAFFIC = [0, 0, 0]
_TRAFFIC_LOCK = threading.Lock()


def traffic() -> Traffic:
    """What this process's :class:`Comm` collectives exchanged so far (take two and subtract
    to see what a save or a load exchanged)."""
    with _TRAFFIC_LOCK:
        return Traffic(*_TRAFFIC)


def _count(sent: int, received: int, collective: bool = True) -> None:
    with _TRAFFIC_LOCK:
        _TRAFFIC[0] += collective
        _TRAFFIC[1] += sent
        _TRAFFIC[2] += received


_SIZE = 8  # an object's size travels as one int64


def _pickled(obj: Any) -> torch.Tensor:
    """``obj``'s pickle, after its length (8 bytes, little-endian)."""
    data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(
        bytearray(len(data).to_bytes(_SIZE, "little") + data), dtype=torch.uint8
    )


def _unpickled(framed: torch.Tensor) -> Any:
    """The object of a :func:`_pickled` frame (padding after it ignored)."""
    view = framed.numpy().data
    size = int.from_bytes(view[:_SIZE], "little")
    return pickle.loads(view[_SIZE : _SIZE + size])


def _longest(size: int, pg: Any) -> int:
    """The largest ``size`` of all ranks (one all-reduce of 8 bytes)."""
    t = torch.tensor([size], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    return int(t)


def _padded(frame: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    out[: len(frame)] = frame
    return out


def _all_gather_bytes(frame: torch.Tensor, pg: Any, world: int) -> list[torch.Tensor]:
    """Every rank's frame, each padded to the longest (the collectives need one size)."""
    longest = _longest(len(frame), pg)
    out = torch.empty(longest * world, dtype=torch.uint8)
    dist.all_gather(list(out.split(longest)), _padded(frame, longest), group=pg)
    _count(_SIZE + longest, _SIZE + (world - 1) * longest)
    return list(out.split(longest))


def _gather_bytes(frame: torch.Tensor, pg: Any, dst: int, receiving: bool) -> list[Any] | None:
    """Every rank's frame on ``dst`` (``receiving``), padded to the longest; None elsewhere."""
    world = dist.get_world_size(pg)
    longest = _longest(len(frame), pg)
    out = torch.empty(longest * world, dtype=torch.uint8) if receiving else None
    parts = list(out.split(longest)) if out is not None else None
    dist.gather(_padded(frame, longest), parts, dst=dst, group=pg)
    if receiving:
        _count(_SIZE, _SIZE + (world - 1) * longest)
    else:
        _count(_SIZE + longest, _SIZE)
    return parts


def _broadcast_bytes(frame: torch.Tensor | None, pg: Any, src: int) -> torch.Tensor:
    """``src``'s frame on every rank: its size, then its bytes."""
    size = torch.tensor([0 if frame is None else len(frame)])
    dist.broadcast(size, src=src, group=pg)
    out = frame if frame is not None else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(out, src=src, group=pg)
    if frame is not None:
        _count(_SIZE + len(out), 0)
    else:
        _count(0, _SIZE + len(out))
    return out


def _span(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" ... {ranks[-1]}" if len(ranks) > 8 else "")


def _gloo_group(ranks: tuple[int, ...], timeout_s: float) -> OwnGroup:
    """The group of ``ranks`` that every Comm over them shares, made on first use (and again
    once torch destroyed it)."""
    with _MAKING:
        with _GROUPS_LOCK:
            found = _GROUPS.get(ranks)
        if found is not None and found.alive:
            return found
        made = OwnGroup(ranks, timeout_s)
        with _GROUPS_LOCK:
            _GROUPS[ranks] = made
        return made


def dedicated_comm(group: Any, timeout_s: float) -> Comm:
    """A :class:`Comm` over ``group``'s ranks with a gloo group of its own (not the one saves
    share), for collectives that may run while a save's background thread uses that one. All
    ranks of the world call it together, in the same order as other group creations."""
    comm = Comm(group, timeout_s)
    if comm._group is not None:
        comm._group = OwnGroup(comm._global_ranks, timeout_s)
    return comm


def failure_of(rank: int, exc: BaseException) -> RankFailure:
    return RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())


def _lines(failed: list[RankFailure]) -> str:
    """One line per distinct error, naming every rank that raised it."""
    ranks: dict[tuple[str, str], list[int]] = {}
    for f in failed:
        ranks.setdefault((f.kind, f.message), []).append(f.rank)
    lines = []
    for (kind, message), rs in ranks.items():
        who = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {_span(rs)}"
        lines.append(f"  {who}: {kind}: {message}")
    return "\n".join(lines)


class Gathering(Protocol):
    """What :func:`run_step` needs of a group: this rank, its size, an object all-gather."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, obj: T) -> list[T]: ...


def run_step(comm: Gathering, step: str, fn: Callable[[], tuple[L, S]]) -> tuple[L, list[S]]:
    """Run ``fn`` on every rank and all-gather its payload; raise everywhere if any rank failed.

    Returns this rank's result and the list of all ranks' results (``fn`` returns what the
    others should see as ``(local, shared)``; shared parts are exchanged).
    """
    local: Any = None
    shared: Any = None
    failure: RankFailure | None = None
    caught: BaseException | None = None
    try:
        local, shared = fn()
    except Exception as e:  # noqa: BLE001 - every failure is reported to every rank
        failure, caught = failure_of(comm.rank, e), e
    gathered = comm.all_gather((failure, shared))
    raise_failures(comm, step, [f for f, _ in gathered], caught)
    return local, [s for _, s in gathered]


def on_every_rank(comm: Gathering, what: str, fn: Callable[[], T]) -> T:
    """``fn()`` run on every rank: its value here, or, when it failed on any rank, that failure
    raised on every rank. For what each rank prepares alone before a collective that all of
    them enter (a save or a load): a rank failing there would leave the others waiting."""
    value, _ = run_step(comm, what, lambda: (fn(), None))
    return value


class Broadcasting(Protocol):
    """What :func:`decide` needs of a group: this rank, its size, an object broadcast."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast(self, obj: T) -> T: ...


def decide(comm: Broadcasting, what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on the coordinator alone and hand its result, or its error, to every rank.

    What one rank reads or checks alone (a listing, a marker, a lock) is a decision the others
    never saw: this makes it one decision. Every rank returns the same value or raises the same
    error (the coordinator's class when it is one of ours), before anyone acts on it.
    """
    value: Any = None
    failure: RankFailure | None = None
    caught: BaseException | None = None
    if comm.rank == 0:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            failure, caught = failure_of(comm.rank, e), e
    if comm.world_size > 1:
        value, failure = comm.broadcast((value, failure))
    raise_failures(comm, what, [failure], caught)
    return value  # type: ignore[no-any-return]


def raise_failures(
    comm: Gathering | Broadcasting,
    step: str,
    failures: list[RankFailure | None],
    caught: BaseException | None,
) -> None:
    """Raise one error on every rank when any rank failed; keep the error's class when shared."""
    failed = [f for f in failures if f is not None]
    if not failed:
        return
    if comm.world_size == 1 and caught is not None:
        raise caught
    kinds = {f.kind for f in failed}
    cls: type[E.CheckpointError] = E.CheckpointError
    if len(kinds) == 1 and isinstance(getattr(E, failed[0].kind, None), type):
        candidate = getattr(E, failed[0].kind)
        is_plain = candidate is not E.DistributedCheckpointError
        if issubclass(candidate, E.CheckpointError) and is_plain:
            cls = candidate
    message = f"{step} failed on {len(failed)} of {comm.world_size} ranks:\n{_lines(failed)}"
    for f in failed:
        log.debug("rank %d traceback during %s:\n%s", f.rank, step, f.trace)
    if cls is E.CheckpointError:
        raise E.DistributedCheckpointError(message, {f.rank: f.message for f in failed}) from caught
    raise cls(message) from caught
