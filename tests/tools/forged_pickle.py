"""DCP ``.metadata`` files forged to run code when unpickled: each creates a marker file."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any


class _System:
    """Unpickles as ``os.system(command)`` (pickle names it ``posix.system``)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


class _Exec:
    """Unpickles as ``exec(source)`` (``builtins.exec``)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (self.source,))


def _short(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def call_pickle(module: str, name: str, arg: str) -> bytes:
    """A protocol 4 pickle calling ``module.name(arg)``; a dotted ``name`` reaches attributes
    of what the module imports (``os.system`` of DCP's metadata module)."""
    return b"\x80\x04" + _short(module) + _short(name) + b"\x93" + _short(arg) + b"\x85R."


FORGERIES = {
    "os.system": "posix.system",
    "builtins.exec": "builtins.exec",
    "dotted name in DCP's module": "torch.distributed.checkpoint.metadata.os.system",
}
"""How each forgery calls code, and the module.name the refusal names."""


def forge_metadata(folder: Path, how: str, marker: Path) -> None:
    """Replace ``folder/.metadata`` by a pickle that creates ``marker`` when loaded: the real
    metadata with the call inside its planner data, or (a dotted name) the call alone."""
    command = f"touch {marker}"
    if how == "dotted name in DCP's module":
        raw = call_pickle("torch.distributed.checkpoint.metadata", "os.system", command)
    else:
        with (folder / ".metadata").open("rb") as f:
            meta = pickle.load(f)  # the test's own, trusted file
        payload = _System(command) if how == "os.system" else _Exec(f"open({str(marker)!r}, 'w')")
        meta.planner_data = {"evil": payload}
        raw = pickle.dumps(meta)
    (folder / ".metadata").write_bytes(raw)
