"""What one benchmark run measures: sizes, systems, places. Validated once, then passed around."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from unickpt.bench.systems.registry import ALL_SYSTEMS, DEFAULT_SYSTEMS, PEER_SYSTEMS

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMbBgG]?)\s*$")
DEVICES = ("cpu", "cuda")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}
#: Short names accepted by ``--systems`` for a system's full name.
SYSTEM_ALIASES = {"torch": "torch-save"}


def parse_param_count(text: str) -> int:
    """Turn ``"10M"``, ``"1.5B"`` or ``"250000"`` into a parameter count.

    >>> parse_param_count("100M")
    100000000
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"parameter count {text!r} is not a number with an optional K/M/B suffix")
    count = int(float(match.group(1)) * _SUFFIX[match.group(2).lower()])
    if count < 100_000:
        raise ValueError(f"parameter count {text!r} is below 100K; pick at least 100K")
    return count


def parse_systems(text: str) -> tuple[str, ...]:
    """Split a comma-separated list of system names; ``"all"``, ``"default"`` and ``"peers"``
    expand, and ``"torch"`` stands for ``"torch-save"``.

    >>> parse_systems("unickpt,dcp,torch")
    ('unickpt', 'dcp', 'torch-save')
    """
    names: list[str] = []
    for raw in text.split(","):
        name = SYSTEM_ALIASES.get(raw.strip(), raw.strip())
        if not name:
            continue
        if name == "all":
            names.extend(ALL_SYSTEMS)
        elif name == "default":
            names.extend(DEFAULT_SYSTEMS)
        elif name == "peers":
            names.extend(PEER_SYSTEMS)
        elif name in ALL_SYSTEMS:
            names.append(name)
        else:
            known = ", ".join((*ALL_SYSTEMS, *SYSTEM_ALIASES))
            raise ValueError(f"unknown system {name!r}; choose among: {known}, all, default, peers")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one ``unickpt bench`` run.

    ``workdir`` holds the checkpoints (on disk, never /dev/shm); ``out`` receives the
    JSON, markdown and PNG reports. ``peers_python`` is the interpreter of the environment
    where the peer systems are installed, or None to mark them "not installed". ``repeats``
    runs of every system, alternating, each in fresh processes; every figure is their median.
    ``device`` ``"cuda"`` puts the state on one GPU per rank (every row reads "skipped" on a
    machine without CUDA). ``time_budget_s``: seconds from the start; no run starts when the
    time spent plus the longest job so far (the hardware job's, before the first run) would
    pass it, and the runs left out count as skipped (None: no budget).
    """

    params: int
    world: int
    systems: tuple[str, ...]
    out: Path
    workdir: Path
    peers_python: str | None = None
    seq_len: int = 64
    warmup: bool = True
    system_timeout_s: float = 900.0
    command: str = ""
    repeats: int = 3
    device: str = "cpu"
    time_budget_s: float | None = None

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world size {self.world} must be at least 1")
        if not self.systems:
            raise ValueError("no system selected; pass --systems with at least one name")
        if self.seq_len < 8:
            raise ValueError(f"sequence length {self.seq_len} must be at least 8")
        if self.repeats < 1:
            raise ValueError(f"repeats {self.repeats} must be at least 1 (3 or more for a range)")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.system_timeout_s <= 0:
            raise ValueError(f"system timeout {self.system_timeout_s} s must be positive")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(
                f"time budget {self.time_budget_s} s must be positive (leave it out for none)"
            )
