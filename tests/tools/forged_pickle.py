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


# -- forgeries that call nothing forbidden: they steer what the allowed names build ----------

PROTO = b"\x80\x04"
MARK, STOP, POP, NONE = b"(", b".", b"0", b"N"
TUPLE1, TUPLE2, REDUCE, BUILD = b"\x85", b"\x86", b"R", b"b"
EMPTY_DICT, EMPTY_TUPLE, NEWOBJ = b"}", b")", b"\x81"
SETITEM, SETITEMS, APPEND, APPENDS, ADDITEMS = b"s", b"u", b"a", b"e", b"\x90"
DCP_METADATA = "torch.distributed.checkpoint.metadata"


def glob(module: str, name: str) -> bytes:
    """GLOBAL: push ``module.name``."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(value: str) -> bytes:
    return _short(value)


def integer(n: int) -> bytes:
    """BININT (4 bytes) or LONG1 for larger ones."""
    if -(2**31) <= n < 2**31:
        return b"J" + n.to_bytes(4, "little", signed=True)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def member(value: int) -> bytes:
    """DCP's ``_MEM_FORMAT_ENCODING(value)``: an enum member, a process-wide object."""
    return glob(DCP_METADATA, "_MEM_FORMAT_ENCODING") + integer(value) + TUPLE1 + REDUCE


def opcode_forgeries(decoy: str) -> dict[str, tuple[bytes, str]]:
    """Opcode sequences that leave the stack as they found it, to prefix to real DCP metadata,
    and what the refusal says; ``decoy``, the file every path of the process would name once
    the first one ran (make it one of the test's own)."""
    return {"BUILD on an allowed class": (_steer_paths(decoy), _STEER_PATHS), **OPCODE_FORGERIES}


def _steer_paths(decoy: str) -> bytes:
    """``setattr(PosixPath, "_str", decoy)``: every ``PosixPath`` then prints as ``decoy``."""
    state = NONE + EMPTY_DICT + text("_str") + text(decoy) + SETITEM + TUPLE2
    return glob("pathlib", "PosixPath") + state + BUILD + POP


_STEER_PATHS = "BUILD to pathlib.PosixPath itself"
OPCODE_FORGERIES: dict[str, tuple[bytes, str]] = {
    # DCP's enum member gets another value, for every reader of the process
    "BUILD on a value it did not make": (
        member(0) + EMPTY_DICT + text("_value_") + integer(7) + SETITEM + BUILD + POP,
        "BUILD to a torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING it did not make",
    ),
    "BUILD twice": (
        glob(DCP_METADATA, "MetadataIndex")
        + EMPTY_TUPLE
        + NEWOBJ
        + EMPTY_DICT
        + text("fqn")
        + text("a")
        + SETITEM
        + BUILD
        + EMPTY_DICT
        + text("fqn")
        + text("b")
        + SETITEM
        + BUILD
        + POP,
        "BUILD to a MetadataIndex that was built already",
    ),
    "SETITEM on a class": (
        glob("collections", "OrderedDict") + text("k") + text("v") + SETITEM + POP,
        "SETITEM to collections.OrderedDict itself",
    ),
    "SETITEMS on a class": (
        glob("collections", "OrderedDict") + MARK + text("k") + text("v") + SETITEMS + POP,
        "SETITEMS to collections.OrderedDict itself",
    ),
    "SETITEM on a value it did not make": (
        member(0) + text("k") + text("v") + SETITEM + POP,
        "SETITEM to a torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING it did not",
    ),
    "APPEND on a class": (
        glob("pathlib", "PosixPath") + text("x") + APPEND + POP,
        "APPEND to pathlib.PosixPath itself",
    ),
    "APPENDS on a class": (
        glob("pathlib", "PosixPath") + MARK + text("x") + APPENDS + POP,
        "APPENDS to pathlib.PosixPath itself",
    ),
    "ADDITEMS on a class": (
        glob("builtins", "set") + MARK + text("x") + ADDITEMS + POP,
        "ADDITEMS to builtins.set itself",
    ),
    "INST": (
        MARK + text("/x") + b"ipathlib\nPosixPath\n" + POP,
        "INST (makes an object of a class named by the file",
    ),
    "OBJ": (
        MARK + glob("pathlib", "PosixPath") + text("/x") + b"o" + POP,
        "OBJ (makes an object of a class on the stack",
    ),
}
"""The forgeries of :func:`opcode_forgeries` that name no file."""

ALLOCATIONS: dict[str, tuple[bytes, str]] = {
    "bytearray(256 MiB)": (
        glob("builtins", "bytearray") + integer(256 << 20) + TUPLE1 + REDUCE + POP,
        "builtins.bytearray called with (268435456,)",
    ),
    "set(range(4 million))": (
        glob("builtins", "set")
        + glob("builtins", "range")
        + integer(4_000_000)
        + TUPLE1
        + REDUCE
        + TUPLE1
        + REDUCE
        + POP,
        "asks pickle to build builtins.range",
    ),
    "frozenset(range(4 million))": (
        glob("builtins", "frozenset")
        + glob("builtins", "range")
        + integer(4_000_000)
        + TUPLE1
        + REDUCE
        + TUPLE1
        + REDUCE
        + POP,
        "asks pickle to build builtins.range",
    ),
}
"""Pickle prefixes that make an allowed constructor allocate what a number says (each at most 48
bytes), and what the refusal says."""


def prefix_metadata(folder: Path, ops: bytes) -> None:
    """Run ``ops`` first when ``folder/.metadata`` (the real one) is unpickled."""
    raw = (folder / ".metadata").read_bytes()
    assert raw[:2] == PROTO
    (folder / ".metadata").write_bytes(PROTO + ops + raw[2:])


def process_state() -> dict[str, Any]:
    """What the forgeries aim at: the attributes of the classes DCP metadata names, of DCP's
    enum members, and how a path prints."""
    import collections
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    classes = [pathlib.PosixPath, pathlib.PurePosixPath, pathlib.Path, collections.OrderedDict]
    classes += [set, frozenset, bytearray, metadata.Metadata, metadata.MetadataIndex]
    classes += [metadata.TensorProperties, filesystem._StorageInfo, metadata._MEM_FORMAT_ENCODING]
    state: dict[str, Any] = {c.__qualname__: sorted(vars(c)) for c in classes}
    state["members"] = {m.name: dict(vars(m)) for m in metadata._MEM_FORMAT_ENCODING}
    state["path"] = str(pathlib.Path("/a/b"))
    return {k: repr(v) for k, v in state.items()}
