"""What a ``torch.distributed.checkpoint`` (DCP) folder pickles, read without running it.

DCP (and Megatron-Core's ``torch_dist`` backend, which saves with DCP) pickles three things: its
``.metadata``; each tensor chunk, a ``torch.save`` archive whose small pickle says where the
tensor's bytes are; and each non-tensor entry, a ``torch.save`` archive of the value. Each is
read by :func:`~unickpt.foreign.plain_pickle.plain_loads` with an allow-list of what such a
pickle holds: the metadata DCP's own dataclasses (``torch.distributed.checkpoint.metadata``,
``.planner``, the file system's ``_StorageInfo``), ``torch.Size``, torch dtypes, layouts and
memory formats, paths and a few containers; a tensor's pickle ``_rebuild_tensor_v2`` of a
storage. Every call's arguments are checked: no constructor is given a size to allocate.

>>> load_dcp_metadata(Path("dcp/step-100/.metadata").read_bytes(), "step-100")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pathlib
import pickle
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsafeObjectError
from .plain_pickle import ALLOW_PICKLE, Call, Record, Refused, plain_loads

CLASS_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed._shard.sharded_tensor.metadata",
)
"""Modules whose dataclasses and enums (defined there) DCP metadata may hold (the last: tensor
properties of metadata written by torch 2.1 and earlier)."""
RECORDS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
"""Other dataclasses DCP metadata holds."""
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_MAX_DIMS = 64
_PATHS = ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


def _ints(value: Any, what: str) -> tuple[int, ...]:
    ok = isinstance(value, (tuple, list)) and len(value) <= _MAX_DIMS
    if not ok or not all(type(n) is int and n >= 0 for n in value):
        raise TypeError(f"{what} must be at most {_MAX_DIMS} non-negative ints")
    return tuple(value)


def _size(dims: Any) -> torch.Size:
    return torch.Size(_ints(dims, "torch.Size"))


def _layout(name: Any) -> torch.layout:
    if not isinstance(name, str):
        raise TypeError("a layout is named by a string")
    found: torch.layout = torch.serialization._get_layout(name)  # type: ignore[no-untyped-call]
    return found


def _items(items: Any = ()) -> list[Any]:
    """The items of a set from a list, tuple or set the pickle holds; a lazy iterable such as a
    range would allocate what its numbers say."""
    if type(items) not in (list, tuple, set, frozenset):
        raise Refused("a set is built from the items the file holds, not a count or a range")
    return list(items)


def _bytearray(data: Any = b"", encoding: Any = None) -> bytearray:
    if isinstance(data, bytes) and encoding is None:
        return bytearray(data)
    if isinstance(data, str) and encoding in ("latin-1", "latin1"):
        return bytearray(data, "latin-1")
    raise Refused("a bytearray is built from the bytes the file holds, not from a size")


def _encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """``bytes`` as protocol 2 pickles them: ``_codecs.encode(str, "latin1")``."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise TypeError("bytes are pickled as a string in latin-1")
    return text.encode("latin-1")


def _slice(*args: Any) -> slice:
    if len(args) > 3 or not all(a is None or type(a) is int for a in args):
        raise TypeError("a slice takes at most three ints or None")
    return slice(*args)


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(type(x) in (int, float) for x in (real, imag)):
        raise TypeError("a complex takes two numbers")
    return complex(real, imag)


def _ordered_dict() -> OrderedDict[Any, Any]:
    return OrderedDict()


def _path(cls: type) -> Call:
    def build(*parts: Any) -> Any:
        if not all(isinstance(p, str) for p in parts):
            raise TypeError("a path is built from strings")
        return cls(*parts)

    return Call(build)


def _enum(cls: type[enum.Enum]) -> Call:
    def build(value: Any) -> Any:
        if type(value) not in (int, str):
            raise TypeError(f"{cls.__qualname__} is built from an int or a string")
        return cls(value)

    return Call(build)


_BUILTINS: dict[tuple[str, str], Call] = {
    ("torch", "Size"): Call(_size),
    ("torch.serialization", "_get_layout"): Call(_layout),
    ("collections", "OrderedDict"): Call(_ordered_dict),
    ("builtins", "set"): Call(lambda items=(): set(_items(items))),
    ("builtins", "frozenset"): Call(lambda items=(): frozenset(_items(items))),
    ("builtins", "slice"): Call(_slice),
    ("builtins", "complex"): Call(_complex),
    ("builtins", "bytearray"): Call(_bytearray),
    ("_codecs", "encode"): Call(_encode),
    **{("pathlib", name): _path(getattr(pathlib, name)) for name in _PATHS},
}


def metadata_globals(module: str, name: str) -> Any:
    """What ``module.name`` stands for in DCP metadata (a value, a call, a record); None
    where DCP metadata does not hold it."""
    if "." in name or name.startswith("__"):
        return None  # dotted names reach attributes of attributes
    if module == "torch":
        value = getattr(torch, name, None)
        if isinstance(value, _TORCH_VALUES):
            return value
    if (module, name) in _BUILTINS:
        return _BUILTINS[(module, name)]
    if module in CLASS_MODULES or (module, name) in RECORDS:
        value = getattr(importlib.import_module(module), name, None)
        if not isinstance(value, type) or value.__module__ != module:
            return None
        if dataclasses.is_dataclass(value):
            return Record(value)
        if issubclass(value, enum.Enum):
            return _enum(value)
    return None


def load_dcp_metadata(raw: bytes, source: str) -> Any:
    """The object pickled in DCP metadata ``raw`` (named ``source`` in errors), built from
    plain data and what DCP metadata holds."""
    return plain_loads(raw, source, metadata_globals, "DCP metadata")


# -- the pickle of a tensor's torch.save archive ---------------------------------------------


@dataclass(frozen=True)
class Rebuilt:
    """What a ``torch.save`` pickle says of one tensor: its storage (dtype name, key and
    elements), storage offset (in elements), size and strides."""

    storage_type: str
    key: str
    numel: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> Rebuilt:
    if not (isinstance(storage, tuple) and len(storage) == 3) or type(offset) is not int:
        raise TypeError("_rebuild_tensor_v2 takes a storage and an offset")
    size, stride = _ints(size, "a size"), _ints(stride, "strides")
    if len(size) != len(stride) or offset < 0:
        raise TypeError("a tensor's size and strides have one entry per dimension")
    return Rebuilt(storage[0], storage[1], storage[2], offset, size, stride)


def _storage(pid: Any) -> tuple[str, str, int]:
    """A storage reference ``('storage', type, key, location, numel)``: nothing is read."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise TypeError(f"an unknown persistent reference {str(pid)[:80]!r}")
    _, kind, key, _, numel = pid
    if not (isinstance(kind, str) and isinstance(key, str) and type(numel) is int):
        raise TypeError("a storage reference names its type, its key and its size")
    return kind, key, numel


def tensor_globals(module: str, name: str) -> Any:
    """What ``module.name`` stands for in the pickle of a tensor ``torch.save`` wrote."""
    if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
        return Call(_rebuild)
    if (module, name) == ("collections", "OrderedDict"):
        return Call(_ordered_dict)
    if module == "torch" and name.endswith("Storage") and hasattr(torch, name):
        return name
    return None


def load_tensor_pickle(raw: bytes, source: str) -> Rebuilt:
    """What the pickle of a tensor's archive says of it; raises ``pickle.UnpicklingError``
    for anything else."""
    found = plain_loads(
        raw,
        source,
        tensor_globals,
        "a tensor saved by DCP",
        _storage,
        "Load it with torch.distributed.checkpoint.load only if you trust it.",
    )
    if not isinstance(found, Rebuilt):
        raise pickle.UnpicklingError(f"a {type(found).__name__} instead of a tensor")
    return found


# -- the pickle of a value's torch.save archive ----------------------------------------------


def _rebuild_parameter(data: Any, requires_grad: Any, *_: Any) -> Rebuilt:
    if not isinstance(data, Rebuilt) or type(requires_grad) is not bool:
        raise TypeError("_rebuild_parameter takes a tensor and a bool")
    return data


def _value_globals(module: str, name: str) -> Any:
    if (module, name) == ("torch._utils", "_rebuild_parameter"):
        return Call(_rebuild_parameter)
    found = tensor_globals(module, name)
    if found is None and not isinstance(metadata_globals(module, name), Record):
        found = metadata_globals(module, name)
    return found


def check_value_archive(raw: bytes | bytearray, source: str) -> None:
    """Refuse a non-tensor entry (a ``torch.save`` archive) whose pickle is more than plain
    data, tensors and the values DCP metadata holds, or whose tensors claim more bytes than
    their records hold, before ``torch.load`` builds it: ``torch.load(weights_only=True)``
    calls ``bytearray``, ``set`` and others with any argument, sizes included."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            names = z.namelist()
            pkl = next((n for n in names if n.endswith("/data.pkl")), None)
            if pkl is None:
                return  # not an archive torch.load reads: it says so itself
            records = {n.rsplit("/", 1)[-1]: z.getinfo(n).file_size for n in names}
            pickled = z.read(pkl)
    except zipfile.BadZipFile:
        return  # a legacy (non-zip) torch.save file: torch.load refuses it with pickle off

    def storage(pid: Any) -> tuple[str, str, int]:
        kind, key, numel = _storage(pid)
        itemsize = _storage_itemsize(kind)
        if key not in records or numel * itemsize > records[key]:
            raise UnsafeObjectError(
                f"{source} has a tensor of {numel} elements of {kind} whose record holds "
                f"{records.get(key, 0)} bytes; unickpt refused it. {ALLOW_PICKLE}"
            )
        return kind, key, numel

    plain_loads(pickled, source, _value_globals, "a value saved by DCP", storage)


def _storage_itemsize(kind: str) -> int:
    with warnings.catch_warnings():  # the typed storage classes are deprecated
        warnings.simplefilter("ignore")
        dtype = getattr(getattr(torch, kind, None), "dtype", None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 1
