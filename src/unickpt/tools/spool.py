"""A scratch file that parks tensors on disk and maps them back.

A save needs every tensor of the state at once. Importers whose source cannot be
memory-mapped (DCP stores each tensor as a ``torch.save`` record) read tensors in bounded
groups, append them here, and hand the save memory-mapped views: the bytes are paged in while
they are written, instead of all being held in memory.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from .blocks import raw_bytes

_ALIGN = 64


@dataclass(frozen=True)
class _Parked:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    numel: int


class Spool:
    """Append tensors with :meth:`add`, then get them back, memory-mapped, from :meth:`tensors`.

    >>> spool = Spool(Path("/tmp/scratch.bin"))  # doctest: +SKIP
    >>> spool.add("w", torch.ones(3))  # doctest: +SKIP
    >>> spool.tensors()["w"]  # doctest: +SKIP
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115 - closed in tensors()
        self._parked: list[_Parked] = []
        self._end = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().cpu().contiguous()
        offset = -(-self._end // _ALIGN) * _ALIGN
        if offset > self._end:
            self._file.write(b"\0" * (offset - self._end))
        if t.numel():
            self._file.write(raw_bytes(t))
        self._end = offset + t.numel() * t.element_size()
        self._parked.append(_Parked(key, t.dtype, tuple(t.shape), offset, t.numel()))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every parked tensor, backed by a private mapping of the file (no copy in memory)."""
        self._file.close()
        if self._end == 0:
            return {p.key: torch.empty(p.shape, dtype=p.dtype) for p in self._parked}
        with open(self.path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        out = {}
        for p in self._parked:
            if p.numel == 0:
                out[p.key] = torch.empty(p.shape, dtype=p.dtype)
                continue
            flat = torch.frombuffer(mapped, dtype=p.dtype, count=p.numel, offset=p.offset)
            out[p.key] = flat.view(p.shape)
        return out
