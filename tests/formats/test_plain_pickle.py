"""The plain-data pickle reader: real DCP pickles read as pickle reads them; forgeries that
steer allowed names, or make them allocate, refused before anything is built."""

from __future__ import annotations

import io
import pickle
import tracemalloc
import zipfile
from collections import OrderedDict
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import unickpt
from unickpt.errors import UnsafeObjectError
from unickpt.foreign.dcp_pickles import (
    check_value_archive,
    load_dcp_metadata,
    load_tensor_pickle,
)
from unickpt.foreign.plain_pickle import plain_loads

from ..tools.forged_pickle import (
    ALLOCATIONS,
    BUILD,
    EMPTY_DICT,
    OPCODE_FORGERIES,
    POP,
    PROTO,
    SETITEM,
    STOP,
    glob,
    integer,
    text,
)


def _nothing(module: str, name: str) -> Any:
    return None


@pytest.mark.parametrize("protocol", [4, 5])
def test_plain_data_reads_as_pickle_reads_it(protocol: int) -> None:
    shared = [1, 2]
    value = {
        "n": [None, True, False, 0, -1, 2**70, 1.5, float("inf"), "s", b"\x00b"],
        "t": ((), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)),
        "sets": [{1, 2}, frozenset({"a"}), set()],
        "shared": [shared, shared],
        "nested": {"a": {"b": [[], {}]}},
    }
    got = plain_loads(pickle.dumps(value, protocol=protocol), "v", _nothing, "a value")
    assert got == value
    assert got["shared"][0] is got["shared"][1]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_reads_as_pickle_reads_it(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "misc": {"p": Path("/a")}}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    raw = (tmp_path / ".metadata").read_bytes()
    ours, theirs = load_dcp_metadata(raw, "m"), pickle.loads(raw)
    assert ours == theirs
    assert ours.storage_data == theirs.storage_data and ours.planner_data == theirs.planner_data
    assert ours.storage_meta == theirs.storage_meta


@pytest.mark.parametrize("name", list(OPCODE_FORGERIES))
def test_each_opcode_forgery_is_refused(name: str) -> None:
    ops, says = OPCODE_FORGERIES[name]
    with pytest.raises(UnsafeObjectError, match=f"applies pickle's {_escaped(says)}"):
        load_dcp_metadata(PROTO + ops + EMPTY_DICT + STOP, "m")


@pytest.mark.parametrize("name", list(ALLOCATIONS))
def test_each_allocation_is_refused(name: str) -> None:
    ops, says = ALLOCATIONS[name]
    with pytest.raises(UnsafeObjectError, match=_escaped(says)):
        load_dcp_metadata(PROTO + ops + EMPTY_DICT + STOP, "m")


def test_allowed_calls_take_only_the_arguments_of_data() -> None:
    """Constructors of the allow-list build what the file holds, nothing from a size."""
    calls = {
        "bytearray": pickle.dumps(bytearray(b"ab"), protocol=2),
        "set": pickle.dumps({1, 2}, protocol=2),
        "frozenset": pickle.dumps(frozenset({1}), protocol=2),
        "ordered": pickle.dumps(OrderedDict(a=1), protocol=2),
        "path": pickle.dumps(PurePosixPath("/a/b"), protocol=2),
        "size": pickle.dumps(torch.Size([2, 3]), protocol=2),
        "complex": pickle.dumps(1 + 2j, protocol=2),
        "slice": pickle.dumps(slice(1, 5, 2), protocol=2),
    }
    for name, raw in calls.items():
        assert load_dcp_metadata(raw, name) == pickle.loads(raw), name
    sized = PROTO + glob("builtins", "frozenset") + integer(10**6) + b"\x85R" + STOP
    with pytest.raises(UnsafeObjectError, match="a set is built from the items the file holds"):
        load_dcp_metadata(sized, "m")


def test_a_tensor_pickle_is_read_and_its_forgeries_refused() -> None:
    buffer = io.BytesIO()
    torch.save(torch.arange(6.0).reshape(2, 3)[:, 1:], buffer)
    with zipfile.ZipFile(buffer) as z:
        raw = z.read("archive/data.pkl")
    found = load_tensor_pickle(raw, "t")
    assert (found.key, found.offset, found.size, found.stride) == ("0", 1, (2, 2), (3, 1))
    steer = glob("torch._utils", "_rebuild_tensor_v2") + EMPTY_DICT + text("__defaults__")
    steer += integer(1) + SETITEM + BUILD + POP
    with pytest.raises(UnsafeObjectError, match=r"BUILD to torch\._utils\._rebuild_tensor_v2"):
        load_tensor_pickle(PROTO + steer + raw[2:], "t")


class _Allocates:
    """Pickles as ``bytearray(n)``: a value whose 30 bytes of pickle allocate ``n`` bytes."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> tuple[Any, ...]:
        return (bytearray, (self.n,))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_value_calling_a_constructor_with_a_size_is_refused(tmp_path: Path) -> None:
    """``torch.load(weights_only=True)`` would build ``bytearray(256 MiB)`` from a DCP value's
    archive; its pickle is read first, and the load refused."""
    dcp.save({"v": _Allocates(256 << 20), "w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(UnsafeObjectError, match=r"builtins\.bytearray called with \(268435456,\)"):
        unickpt.load(tmp_path, {"v": None, "w": torch.zeros(2)})
    buffer = io.BytesIO()
    torch.save({"a": [1, b"x"], "t": torch.arange(3), "d": torch.float16}, buffer)
    check_value_archive(buffer.getvalue(), "plain")  # plain data and tensors pass


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize(
    "raw",
    [
        PROTO + b"\x8e" + (1 << 40).to_bytes(8, "little") + b"abc" + STOP,  # BINBYTES8 of 1 TiB
        PROTO + b"\x96" + (1 << 40).to_bytes(8, "little") + STOP,  # BYTEARRAY8 of 1 TiB
        PROTO + EMPTY_DICT + b"r" + (2**32 - 1).to_bytes(4, "little") + STOP,  # memo slot 4G
        PROTO + b"\x8b" + (-5).to_bytes(4, "little", signed=True) + STOP,  # negative length
        PROTO + EMPTY_DICT,  # no STOP
        PROTO + b"I12\n" + STOP,  # protocol 0 text
        b"\xff" + STOP,
        PROTO + STOP,  # empty stack
    ],
)
def test_malformed_pickles_are_damage_and_allocate_nothing(raw: bytes) -> None:
    """Lengths and indexes the bytes state are checked against the bytes there are."""
    tracemalloc.start()
    try:
        try:
            found: Any = load_dcp_metadata(raw, "m")
        except pickle.UnpicklingError as e:
            found = e
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert isinstance(found, (pickle.UnpicklingError, dict)), found
