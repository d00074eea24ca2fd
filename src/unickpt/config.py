"""Tunables in one validated place, with environment overrides (``UNICKPT_<FIELD>``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from .errors import CheckpointError

MiB = 1 << 20


@dataclass(frozen=True)
class Config:
    """Engine settings. Read once per call from the environment; see :func:`get_config`."""

    io_threads: int = 4
    """Threads per rank that write and read files (and S3 requests in flight)."""
    window_bytes: int = 64 * MiB
    """A data file is written in parts of about this size."""
    segment_bytes: int = 1 * MiB
    """Checksum segment: chunks are hashed in pieces of this size; verified loads read whole
    segments."""
    small_chunk_bytes: int = 1 * MiB
    """Chunks below this are never cut across parts."""
    staging_budget_bytes: int = 16 * 1024 * MiB
    """The most host memory an asynchronous save's snapshot takes per rank (a larger state is
    copied through a ring of this size as it is written)."""
    read_piece_bytes: int = 64 * MiB
    """Loads read large chunks in pieces of about this size."""
    verify: bool = True
    """Check every chunk's checksums on load."""
    share_reads: bool = True
    """Ranks on one host read each saved chunk once and share it (resharded loads)."""
    share_across_nodes: bool = True
    """Bytes that ranks of several nodes load (replicas) are fetched from storage by one rank and
    sent to the others over the process group; off: each node reads them."""
    collective_timeout_s: float = 1800.0
    """How long a rank waits for the others in a collective before failing."""
    replica_share_bytes: int = 16 * MiB
    """A box several ranks hold, of at least twice this, is written in shares of at least
    this by several of them (one share per holder at most); 0 writes every box whole."""

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise CheckpointError(f"io_threads is {self.io_threads}; expected at least 1.")
        if self.segment_bytes < 4096 or self.segment_bytes % 4096:
            raise CheckpointError(
                f"segment_bytes is {self.segment_bytes}; expected a multiple of 4096."
            )
        for name in ("window_bytes", "read_piece_bytes"):
            value = getattr(self, name)
            if value < self.segment_bytes or value % self.segment_bytes:
                raise CheckpointError(
                    f"{name} is {value}; expected a multiple of segment_bytes "
                    f"({self.segment_bytes})."
                )
        if self.staging_budget_bytes < self.window_bytes:
            raise CheckpointError(
                f"staging_budget_bytes is {self.staging_budget_bytes}; expected at least "
                f"window_bytes ({self.window_bytes})."
            )
        if self.collective_timeout_s <= 0:
            raise CheckpointError("collective_timeout_s must be positive.")
        if self.replica_share_bytes < 0:
            raise CheckpointError(
                f"replica_share_bytes is {self.replica_share_bytes}; expected 0 (write every "
                "replicated box whole) or more."
            )


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse(value: str, kind: type) -> object:
    if kind is bool:
        word = value.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(value)
        return word in _TRUE
    return kind(value)


def env_overrides(cls: type, prefix: str) -> dict[str, object]:
    """The fields of dataclass ``cls`` set in the environment as ``<prefix><FIELD>``, parsed by
    the type of the field's default. A variable set empty counts as unset, except for text."""
    env: dict[str, object] = {}
    for f in fields(cls):
        name = f"{prefix}{f.name.upper()}"
        raw = os.environ.get(name)
        kind = type(f.default)
        if raw is None or (kind is not str and not raw.strip()):
            continue
        try:
            env[f.name] = _parse(raw, kind)
        except ValueError:
            words = f" (one of {', '.join(_TRUE + _FALSE)})" if kind is bool else ""
            raise CheckpointError(
                f"{name}={raw!r} is not a valid {kind.__name__}{words}; correct it or unset it."
            ) from None
    return env


def get_config(**overrides: object) -> Config:
    """The defaults, then ``UNICKPT_*`` environment variables, then ``overrides``."""
    known = {f.name for f in fields(Config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise CheckpointError(
            f"unknown config field(s) {', '.join(unknown)}; "
            f"expected some of {', '.join(sorted(known))}."
        )
    merged = {**env_overrides(Config, "UNICKPT_"), **overrides}  # an argument beats the environment
    return replace(Config(), **merged)  # type: ignore[arg-type]
