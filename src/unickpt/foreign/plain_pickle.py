"""A pickle reader that builds plain data and, of anything else, only what an allow-list names,
from arguments it checks.

A pickle is a program, not a description: besides naming what to call, it can apply ``BUILD``
to any object it reaches (setting an attribute of an allowed class sets it for the whole
process: a forged DCP ``.metadata`` that sets ``_str`` on ``pathlib.PosixPath`` redirects every
path), append to or set items of any object, and have an allowed constructor allocate what a
number in the file says (``bytearray(2**30)`` from 30 bytes). Checking the names a pickle holds
(``pickle.Unpickler.find_class``) stops none of that. This reader decodes the binary opcodes
itself (an argument's length is checked against the bytes left before it is read) and builds:

- plain data from what the file holds, so that nothing outgrows the file: None, bools, ints,
  floats, strings, bytes, bytearrays, tuples, lists, dicts, sets and frozensets;
- the values the allow-list names (``torch.float32``);
- a :class:`Call` (``REDUCE``) of a callable it names, whose builder checks the arguments
  before it builds (it raises :class:`Refused` for a call that is not data, such as a
  constructor given a size);
- a :class:`Record`: a dataclass it names, made empty (``NEWOBJ``) and given its own fields
  once (``BUILD``).

``APPEND(S)``, ``SETITEM(S)`` and ``ADDITEMS`` apply only to containers this reading made;
``BUILD`` only to a record it made, once; a class or function named by the file is never a
value. ``INST``, ``OBJ``, extension codes and out-of-band buffers are refused, and persistent
references unless the caller reads them. A refusal raises
:class:`~unickpt.errors.UnsafeObjectError` before anything outside the objects of this reading
changed; a malformed pickle raises :class:`pickle.UnpicklingError`.

>>> plain_loads(pickle.dumps({"a": [1, 2.5, b"x"]}), "x.pkl", lambda m, n: None, "a value")
{'a': [1, 2.5, b'x']}
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import functools
import pickle
import pickletools
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ..errors import UnsafeObjectError

ALLOW_PICKLE = (
    "Pass --allow-pickle (allow_pickle=True) only if you trust where the checkpoint comes from."
)


class Refused(Exception):
    """Raised by a :class:`Call`'s builder for arguments that are not data (a size to allocate,
    a lazy range); :class:`TypeError` or :class:`ValueError` mean a malformed pickle."""


@dataclass(frozen=True)
class Call:
    """A callable a pickle may call (``REDUCE``): ``build(*args)`` checks and builds."""

    build: Callable[..., Any]


@dataclass(frozen=True)
class Record:
    """A dataclass a pickle may make empty (``NEWOBJ``) and fill with its fields (``BUILD``)."""

    cls: type


Resolver = Callable[[str, str], Any]
"""``(module, name)`` to the value, :class:`Call` or :class:`Record` it stands for; None to
refuse it."""


@dataclass(frozen=True)
class _Named:
    """A callable or class the pickle named: usable only where it is called or made."""

    module: str
    name: str
    target: Call | Record

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_CONTAINERS = (list, dict, set, OrderedDict)
_NEVER = {
    "INST": "makes an object of a class named by the file (protocol 0)",
    "OBJ": "makes an object of a class on the stack (protocol 1)",
    "EXT1": "names a class by the copyreg extension registry",
    "EXT2": "names a class by the copyreg extension registry",
    "EXT4": "names a class by the copyreg extension registry",
    "NEXT_BUFFER": "reads an out-of-band buffer",
    "READONLY_BUFFER": "reads an out-of-band buffer",
}


def plain_loads(
    raw: bytes,
    source: str,
    resolve: Resolver,
    holds: str,
    persistent: Callable[[Any], Any] | None = None,
    advice: str = ALLOW_PICKLE,
) -> Any:
    """The object pickled in ``raw``, built as the module says. ``source`` names the file in
    errors, ``holds`` what such a file holds ("DCP metadata"), ``advice`` what a user may do
    about a refusal; ``persistent`` reads persistent references (refused without it)."""
    return _Reader(raw, source, resolve, holds, persistent, advice).load()


class _Reader:
    def __init__(
        self,
        raw: bytes,
        source: str,
        resolve: Resolver,
        holds: str,
        persistent: Callable[[Any], Any] | None,
        advice: str,
    ) -> None:
        self.raw, self.source, self.resolve, self.holds = raw, source, resolve, holds
        self.persistent, self.advice = persistent, advice
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.made: dict[int, Any] = {}  # id -> container made here (kept alive)
        self.empty: dict[int, Any] = {}  # id -> record made here and not filled yet
        self.filled: dict[int, Any] = {}  # id -> record filled here (kept alive)

    def load(self) -> Any:
        raw, table, memo, end = self.raw, _table(self), self.memo, len(self.raw)
        pos, at, name = 0, 0, ""
        try:
            while pos < end:
                at, code = pos, raw[pos]
                if code == _MEMOIZE:  # the most frequent opcodes, without a call
                    memo[len(memo)] = self.stack[-1]
                    pos += 1
                    continue
                if code in (_BINGET, _BININT1):
                    value = raw[pos + 1]
                    self.stack.append(memo[value] if code == _BINGET else value)
                    pos += 2
                    continue
                if code == _LONG_BINGET:
                    self.stack.append(memo[_U4.unpack_from(raw, pos + 1)[0]])
                    pos += 5
                    continue
                read, handler, name = table[code] or _unread(code)
                pos += 1
                arg = None
                if read is not None:
                    arg, pos = read(raw, pos)
                if handler is None:
                    return self._stop()
                handler(arg)
        except (UnsafeObjectError, pickle.UnpicklingError):
            raise
        except (IndexError, KeyError, TypeError, ValueError, AttributeError, struct.error) as e:
            raise pickle.UnpicklingError(f"{name} at byte {at}: {e}") from e
        except (RecursionError, OverflowError, MemoryError) as e:
            raise pickle.UnpicklingError(f"{name} at byte {at}: {type(e).__name__}") from e
        raise pickle.UnpicklingError("the pickle ends without STOP")

    def _push(self, value: Any) -> None:
        self.stack.append(value)

    def _push_constant(self, value: Any, _: Any) -> None:
        self.stack.append(value)

    def _ignore(self, _: Any) -> None:
        pass

    def _never(self, what: str, _: Any) -> None:
        self._refuse(what)

    # -- the stack, marks and memo ------------------------------------------------------

    def _pop_mark(self) -> list[Any]:
        items = self.stack
        self.stack = self.marks.pop()
        return items

    def _op_mark(self, _: Any) -> None:
        self.marks.append(self.stack)
        self.stack = []

    def _op_pop(self, _: Any) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self._pop_mark()

    def _op_pop_mark(self, _: Any) -> None:
        self._pop_mark()

    def _op_dup(self, _: Any) -> None:
        self.stack.append(self.stack[-1])

    def _put(self, index: int) -> None:
        self.memo[index] = self.stack[-1]

    _op_binput = _op_long_binput = _put

    def _op_memoize(self, _: Any) -> None:
        self.memo[len(self.memo)] = self.stack[-1]

    def _get(self, index: int) -> None:
        self.stack.append(self.memo[index])

    _op_binget = _op_long_binget = _get

    # -- plain data ------------------------------------------------------------------------

    def _new(self, container: Any) -> None:
        self.made[id(container)] = container
        self.stack.append(container)

    def _op_empty_list(self, _: Any) -> None:
        self._new([])

    def _op_empty_dict(self, _: Any) -> None:
        self._new({})

    def _op_empty_set(self, _: Any) -> None:
        self._new(set())

    def _op_empty_tuple(self, _: Any) -> None:
        self.stack.append(())

    def _op_list(self, _: Any) -> None:
        self._new(self._data(self._pop_mark()))

    def _op_tuple(self, _: Any) -> None:
        items = tuple(self._data(self._pop_mark()))
        self.stack.append(items)  # to the stack below the mark

    def _tuple_of(self, n: int) -> None:
        items = self.stack[-n:]
        if len(items) != n:
            raise IndexError("too few items on the stack")
        del self.stack[-n:]
        self.stack.append(tuple(self._data(items)))

    def _op_tuple1(self, _: Any) -> None:
        self._tuple_of(1)

    def _op_tuple2(self, _: Any) -> None:
        self._tuple_of(2)

    def _op_tuple3(self, _: Any) -> None:
        self._tuple_of(3)

    def _op_dict(self, _: Any) -> None:
        items = self._data(self._pop_mark())
        self._new(dict(zip(items[::2], items[1::2], strict=True)))

    def _op_frozenset(self, _: Any) -> None:
        items = frozenset(self._data(self._pop_mark()))
        self.stack.append(items)

    def _op_bytearray8(self, arg: bytes) -> None:
        self._new(bytearray(arg))

    def _target(self, op: str, kinds: tuple[type, ...]) -> Any:
        """The object ``op`` changes (the top of the stack): a container of ``kinds`` this
        reading made."""
        target = self.stack[-1]
        if id(target) not in self.made or type(target) not in kinds:
            self._refuse(f"{op} to {self._describe(target)}", changes=True)
        return target

    def _op_append(self, _: Any) -> None:
        (value,) = self._data([self.stack.pop()])
        self._target("APPEND", (list,)).append(value)

    def _op_appends(self, _: Any) -> None:
        items = self._data(self._pop_mark())
        self._target("APPENDS", (list,)).extend(items)

    def _op_setitem(self, _: Any) -> None:
        key, value = self._data(self.stack[-2:])
        del self.stack[-2:]
        self._target("SETITEM", (dict, OrderedDict))[key] = value

    def _op_setitems(self, _: Any) -> None:
        items = self._data(self._pop_mark())
        target = self._target("SETITEMS", (dict, OrderedDict))
        for key, value in zip(items[::2], items[1::2], strict=True):
            target[key] = value

    def _op_additems(self, _: Any) -> None:
        items = self._data(self._pop_mark())
        self._target("ADDITEMS", (set,)).update(items)

    # -- what the allow-list names ------------------------------------------------------

    def _op_global(self, arg: str) -> None:
        module, _, name = arg.partition(" ")
        self._named(module, name)

    def _op_stack_global(self, _: Any) -> None:
        name, module = self.stack.pop(), self.stack.pop()
        if not (isinstance(module, str) and isinstance(name, str)):
            raise TypeError("STACK_GLOBAL needs two strings")
        self._named(module, name)

    def _named(self, module: str, name: str) -> None:
        current = (module, name)  # Python 2 names (protocol 2) as Python 3 calls them
        current = _compat_pickle.NAME_MAPPING.get(current, current)
        current = (_compat_pickle.IMPORT_MAPPING.get(current[0], current[0]), current[1])
        found = self.resolve(*current)
        if found is None:
            raise UnsafeObjectError(
                f"{self.source} asks pickle to build {module}.{name}, which {self.holds} does "
                "not hold; unickpt refused it, since unpickling it could run code from the "
                f"file. {self.advice}"
            )
        kept = isinstance(found, (Call, Record))
        self.stack.append(_Named(*current, found) if kept else found)

    def _op_reduce(self, _: Any) -> None:
        args = self.stack.pop()
        named = self.stack.pop()
        if not isinstance(named, _Named) or not isinstance(named.target, Call):
            self._refuse(f"REDUCE to {self._describe(named)}")
        if not isinstance(args, tuple):
            raise TypeError(f"REDUCE with {type(args).__name__} arguments")
        try:
            value = named.target.build(*args)
        except Refused as e:
            self._refuse(f"{named.qualname} called with {_shown(args)} ({e})")
        except (TypeError, ValueError, KeyError, RuntimeError, NotImplementedError) as e:
            raise pickle.UnpicklingError(f"{named.qualname}{_shown(args)}: {e}") from e
        if type(value) in _CONTAINERS:
            self.made[id(value)] = value
        self.stack.append(value)

    def _op_newobj(self, _: Any) -> None:
        self._make(self.stack.pop(), {})

    def _op_newobj_ex(self, _: Any) -> None:
        kwargs = self.stack.pop()
        self._make(self.stack.pop(), kwargs)

    def _make(self, args: Any, kwargs: Any) -> None:
        named = self.stack.pop()
        if not isinstance(named, _Named) or not isinstance(named.target, Record):
            self._refuse(f"NEWOBJ to {self._describe(named)}")
        if args != () or kwargs != {}:
            raise TypeError(f"{named.qualname} is made without arguments, got {_shown(args)}")
        cls = named.target.cls
        if not dataclasses.is_dataclass(cls):
            self._refuse(f"NEWOBJ to {named.qualname}, which is not a record")
        record = cls.__new__(cls)
        self.empty[id(record)] = record
        self.stack.append(record)

    def _op_build(self, _: Any) -> None:
        (state,) = self._data([self.stack.pop()])
        record = self.stack[-1]
        if id(record) not in self.empty:
            self._refuse(f"BUILD to {self._describe(record)}", changes=True)
        del self.empty[id(record)]
        self.filled[id(record)] = record
        _fill(record, state)

    def _op_binpersid(self, _: Any) -> None:
        (pid,) = self._data([self.stack.pop()])
        self._persistent(pid)

    def _persistent(self, pid: Any) -> None:
        if self.persistent is None:
            raise UnsafeObjectError(
                f"{self.source} holds a persistent pickle reference ({str(pid)[:80]!r}), which "
                f"{self.holds} does not hold. {self.advice}"
            )
        self.stack.append(self.persistent(pid))

    # -- the end, and refusals ------------------------------------------------------------

    def _stop(self) -> Any:
        (value,) = self._data([self.stack.pop()])
        if self.stack or self.marks:
            raise pickle.UnpicklingError("items are left on the stack at STOP")
        for record in self.empty.values():  # made, never given a state: its defaults
            _fill(record, None)
        return value

    def _data(self, items: list[Any]) -> list[Any]:
        """``items``, refused where one is a class or function the pickle named (never data)."""
        if _Named in map(type, items):  # rare: checked at C speed first
            named = next(i for i in items if isinstance(i, _Named))
            self._refuse(f"{named.qualname} as a value")
        return items

    def _describe(self, target: Any) -> str:
        if isinstance(target, _Named):
            return f"{target.qualname} itself"
        if id(target) in self.filled:
            return f"a {type(target).__qualname__} that was built already"
        return f"a {type(target).__module__}.{type(target).__qualname__} it did not make"

    def _refuse(self, what: str, changes: bool = False) -> NoReturn:
        why = " (it would change an object of the process)" if changes else ""
        raise UnsafeObjectError(
            f"{self.source} applies pickle's {what}{why}, which {self.holds} never does; "
            f"unickpt refused it. {self.advice}"
        )


# -- decoding: each opcode's argument, read from the bytes (never past their end) -------------

Read = Callable[[bytes, int], tuple[Any, int]]
"""Reads an opcode's argument at a position: the argument and the position after it."""


def _fixed(fmt: str) -> Read:
    size = struct.calcsize(fmt)

    def read(raw: bytes, pos: int) -> tuple[Any, int]:
        return struct.unpack_from(fmt, raw, pos)[0], pos + size

    return read


def _counted(fmt: str, make: Callable[[bytes], Any]) -> Read:
    """An argument of as many bytes as the length before it says (checked against the end)."""
    size = struct.calcsize(fmt)

    def read(raw: bytes, pos: int) -> tuple[Any, int]:
        (n,) = struct.unpack_from(fmt, raw, pos)
        start = pos + size
        data = raw[start : start + n]
        if n < 0 or len(data) != n:
            raise ValueError(f"{n} bytes announced, {len(data)} left")
        return make(data), start + n

    return read


def _lines(count: int) -> Read:
    def read(raw: bytes, pos: int) -> tuple[Any, int]:
        out = []
        for _ in range(count):
            end = raw.index(b"\n", pos)
            out.append(raw[pos:end].decode("utf-8"))
            pos = end + 1
        return " ".join(out), pos

    return read


def _long(data: bytes) -> int:
    return int.from_bytes(data, "little", signed=True)


def _text(data: bytes) -> str:
    return data.decode("utf-8", "surrogatepass")


def _ascii(data: bytes) -> str:
    return data.decode("ascii")


_ARGUMENTS: dict[str, Read] = {
    "PROTO": _fixed("<B"),
    "FRAME": _fixed("<Q"),
    "BININT": _fixed("<i"),
    "BININT1": _fixed("<B"),
    "BININT2": _fixed("<H"),
    "BINFLOAT": _fixed(">d"),
    "LONG1": _counted("<B", _long),
    "LONG4": _counted("<i", _long),
    "SHORT_BINBYTES": _counted("<B", bytes),
    "BINBYTES": _counted("<I", bytes),
    "BINBYTES8": _counted("<Q", bytes),
    "BYTEARRAY8": _counted("<Q", bytes),
    "SHORT_BINUNICODE": _counted("<B", _text),
    "BINUNICODE": _counted("<I", _text),
    "BINUNICODE8": _counted("<Q", _text),
    "SHORT_BINSTRING": _counted("<B", _ascii),
    "BINSTRING": _counted("<i", _ascii),
    "BINGET": _fixed("<B"),
    "LONG_BINGET": _fixed("<I"),
    "BINPUT": _fixed("<B"),
    "LONG_BINPUT": _fixed("<I"),
    "GLOBAL": _lines(2),
    "INST": _lines(2),
    "EXT1": _fixed("<B"),
    "EXT2": _fixed("<H"),
    "EXT4": _fixed("<i"),
}
"""The argument of each binary opcode that has one (the text opcodes of protocol 0 are not
read, but for ``GLOBAL``, which protocol 2 uses too, and ``INST``, to refuse it)."""
_VALUES = {
    "BININT", "BININT1", "BININT2", "BINFLOAT", "LONG1", "LONG4", "SHORT_BINBYTES",
    "BINBYTES", "BINBYTES8", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "SHORT_BINSTRING", "BINSTRING",
}  # fmt: skip


def _table(reader: _Reader) -> list[tuple[Read | None, Callable[[Any], None] | None, str] | None]:
    """Per opcode byte: how its argument is read, what it does (None: ``STOP``), its name."""
    table: list[tuple[Read | None, Callable[[Any], None] | None, str] | None] = [None] * 256
    for op in pickletools.opcodes:
        name = op.name
        handler: Callable[[Any], None] | None = getattr(reader, f"_op_{name.lower()}", None)
        if name in _VALUES:
            handler = reader._push
        elif name in _CONSTANTS:
            handler = functools.partial(reader._push_constant, _CONSTANTS[name])
        elif name in ("PROTO", "FRAME"):
            handler = reader._ignore
        elif name in _NEVER:
            handler = functools.partial(reader._never, f"{name} ({_NEVER[name]})")
        elif name != "STOP" and handler is None:
            continue  # a text opcode of protocol 0: not read
        table[op.code.encode("latin-1")[0]] = (_ARGUMENTS.get(name), handler, name)
    return table


_MEMOIZE, _BINGET, _LONG_BINGET = pickle.MEMOIZE[0], pickle.BINGET[0], pickle.LONG_BINGET[0]
_BININT1 = pickle.BININT1[0]
_U4 = struct.Struct("<I")


def _unread(code: int) -> tuple[Read, None, str]:
    raise pickle.UnpicklingError(
        f"opcode {bytes([code])!r} is not one this reader reads (protocol 0 text, or not pickle)"
    )


def _fill(record: Any, state: Any) -> None:
    """Give a record its state as ``BUILD`` does: to its class's own ``__setstate__``, or as
    ``__dict__`` entries (strings; Megatron adds some to DCP's metadata) and, for a
    ``(__dict__, slots)`` pair, slots set by name (its fields only). Fields it lacks take their
    defaults."""
    cls = type(record)
    setstate = getattr(cls, "__setstate__", None)
    if setstate is not None and state is not None:
        try:
            setstate(record, state)
        except (TypeError, ValueError, RuntimeError) as e:
            raise pickle.UnpicklingError(f"{cls.__qualname__} state {_shown(state)}: {e}") from e
        return
    fields = _fields(cls)
    own, slots = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
    for part in (own, slots):
        if part is not None and not (isinstance(part, dict) and set(map(type, part)) <= {str}):
            raise TypeError(f"{cls.__qualname__} state is not a dict of names")
    if own:
        vars(record).update(own)
    for name, value in (slots or {}).items():
        if name not in fields:
            raise pickle.UnpicklingError(f"{cls.__qualname__} has no field {name!r}")
        object.__setattr__(record, name, value)
    for name, f in fields.items():
        if name in getattr(record, "__dict__", ()):
            continue
        if f.default_factory is not dataclasses.MISSING:
            object.__setattr__(record, name, f.default_factory())
        elif f.default is dataclasses.MISSING:
            raise pickle.UnpicklingError(f"{cls.__qualname__} lacks its field {name!r}")


_FIELDS: dict[type, dict[str, dataclasses.Field[Any]]] = {}


def _fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    found = _FIELDS.get(cls)
    if found is None:
        found = _FIELDS[cls] = {f.name: f for f in dataclasses.fields(cls)}
    return found


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
