"""Reading the pickled ``.metadata`` of a ``torch.distributed.checkpoint`` folder without
running code from it.

DCP (and Megatron-Core's ``torch_dist`` backend, which saves with DCP) writes its metadata with
pickle, and pickle builds whatever classes and calls whatever functions the file names. Its
metadata only ever names DCP's own dataclasses (``torch.distributed.checkpoint.metadata``,
``.planner``, the file system's ``_StorageInfo``), ``torch.Size``, torch dtypes, layouts and
memory formats, paths and a few containers: :class:`RestrictedUnpickler` builds those and
refuses any other with :class:`~unickpt.errors.UnsafeObjectError`, before anything is built
from it.

>>> with open("dcp/step-100/.metadata", "rb") as f:  # doctest: +SKIP
...     meta = load_restricted(f, "dcp/step-100/.metadata")
"""

from __future__ import annotations

import importlib
import pickle
from typing import IO, Any

import torch

from ..errors import UnsafeObjectError

CLASS_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed._shard.sharded_tensor.metadata",
)
"""Modules whose classes (defined there) DCP metadata may hold, any of them (the last: tensor
properties of metadata written by torch 2.1 and earlier)."""
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "complex"),
        ("builtins", "bytearray"),
        ("builtins", "range"),
    }
)
"""Other names DCP metadata may hold (its ``checkpoint_id`` may be a path)."""
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds only what DCP metadata holds; ``source`` names the file in
    its errors."""

    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise UnsafeObjectError(
                f"{self.source} asks pickle to build {module}.{name}, which DCP metadata does "
                "not hold; unickpt refused it, since unpickling it could run code from the "
                "file. Pass --allow-pickle (allow_pickle=True) only if you trust where the "
                "checkpoint comes from."
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeObjectError(
            f"{self.source} holds a persistent pickle reference ({str(pid)[:80]!r}), which DCP "
            "metadata does not hold; pass --allow-pickle only for a trusted source."
        )


def load_restricted(file: IO[bytes], source: str) -> Any:
    """The object pickled in ``file``, built by :class:`RestrictedUnpickler`."""
    return RestrictedUnpickler(file, source).load()


def _allowed(module: str, name: str) -> Any | None:
    """What ``module.name`` is where DCP metadata may hold it; None otherwise."""
    if "." in name or name.startswith("__"):
        return None  # dotted names reach attributes of attributes
    if module == "torch":
        value = getattr(torch, name, None)
        if isinstance(value, _TORCH_VALUES) or value is torch.Size:
            return value
        return None
    if (module, name) in ALLOWED:
        return getattr(importlib.import_module(module), name)
    if module in CLASS_MODULES:
        value = getattr(importlib.import_module(module), name, None)
        if isinstance(value, type) and value.__module__ == module:
            return value
    return None
