"""A pickle reader that builds plain data and, of anything else, only what an allow-list names,
from arguments it checks.

A pickle is a program, not a description: besides naming what to call, it can apply ``BUILD``
to any object it reaches (setting an attribute of an allowed class sets it for the whole
process: a forged DCP ``.metadata`` that sets ``_str`` on ``pathlib.PosixPath`` redirects every
path), append to or set items of any object, and have an allowed constructor allocate what a
number in the file says (``bytearray(2**30)`` from 30 bytes). Checking the names a pickle holds
(``pickle.Unpickler.find_class``) stops none of that. This reader decodes the opcodes with
:func:`pickletools.genops`, which only reads, and builds:

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
import io
import pickle
import pickletools
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
_ARGUMENT_IS_VALUE = {
    *("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"),
    *("STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE"),
    *("BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8"),
}
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
        op_name, pos = "", 0
        try:
            for op, arg, at in pickletools.genops(io.BytesIO(self.raw)):
                op_name, pos = op.name, at or 0
                if op_name == "STOP":
                    return self._stop()
                self._step(op_name, arg)
        except (UnsafeObjectError, pickle.UnpicklingError):
            raise
        except (IndexError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise pickle.UnpicklingError(f"{op_name} at byte {pos}: {e}") from e
        except (RecursionError, OverflowError, MemoryError) as e:
            raise pickle.UnpicklingError(f"{op_name} at byte {pos}: {type(e).__name__}") from e
        raise pickle.UnpicklingError("the pickle ends without STOP")

    def _step(self, op: str, arg: Any) -> None:
        if op in _ARGUMENT_IS_VALUE:
            self.stack.append(arg)
        elif op in _CONSTANTS:
            self.stack.append(_CONSTANTS[op])
        elif op in ("PROTO", "FRAME"):
            pass
        elif op in _NEVER:
            self._refuse(f"{op} ({_NEVER[op]})")
        else:
            handler = getattr(self, f"_op_{op.lower()}", None)
            if handler is None:
                raise pickle.UnpicklingError(f"opcode {op} is not read")
            handler(arg)

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

    def _op_put(self, index: int) -> None:
        self.memo[index] = self.stack[-1]

    _op_binput = _op_long_binput = _op_put

    def _op_memoize(self, _: Any) -> None:
        self.memo[len(self.memo)] = self.stack[-1]

    def _op_get(self, index: int) -> None:
        self.stack.append(self.memo[index])

    _op_binget = _op_long_binget = _op_get

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

    def _op_persid(self, pid: Any) -> None:
        self._persistent(pid)

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
        for item in items:
            if isinstance(item, _Named):
                self._refuse(f"{item.qualname} as a value")
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
    fields = {f.name: f for f in dataclasses.fields(cls)}
    own, slots = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
    for part in (own, slots):
        if part is not None and not (
            isinstance(part, dict) and all(isinstance(k, str) for k in part)
        ):
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


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
