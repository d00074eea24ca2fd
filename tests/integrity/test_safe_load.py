"""Safe loading: no pickle unless allowed, no file outside the folder, crafted metadata refused.

The forgeries rewrite the metadata (or an index) and re-pin every size and checksum, so the
checkpoint looks intact: only the loader's own checks stand between it and the caller.
"""

from __future__ import annotations

import base64
import collections
import copy
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from tests.integrity._helpers import metadata_path, read_commit, read_metadata, repin, same_tensor
from tests.integrity.test_damage import CONFIG, _blank, _one_rank_state, _wrong_values


class Opaque:
    """A plain object: it has no state_dict, so only pickle can store it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


class RunsCode:
    """Unpickling it creates a folder: the proof that a checkpoint ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


@pytest.fixture
def pickled(tmp_path: Path) -> Path:
    path = tmp_path / "pickled"
    state = {"w": torch.arange(6.0), "obj": Opaque(41), "plain": 3}
    unickpt.save(path, state, allow_pickle=True)
    return path


def test_pickled_object_refused_without_allow_pickle(pickled: Path) -> None:
    state = {"w": torch.zeros(6), "obj": None, "plain": 0}
    with pytest.raises(unickpt.UnsafeObjectError) as info:
        unickpt.load(pickled, state)
    message = str(info.value)
    assert "holds pickled objects (obj)" in message
    assert "could run code from the checkpoint" in message and "allow_pickle=True" in message
    assert state["obj"] is None and state["plain"] == 0, "a refused load changed the state"
    assert same_tensor(state["w"], torch.zeros(6)), "a refused load changed the state"

    unickpt.load(pickled, state, allow_pickle=True)
    assert state["obj"] == Opaque(41) and state["plain"] == 3
    assert same_tensor(state["w"], torch.arange(6.0))


def test_pickle_smuggled_past_pickled_keys_is_not_run(pickled: Path, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    doc = read_metadata(pickled)
    doc["pickled_keys"] = []
    evil = base64.b64encode(pickle.dumps(RunsCode(marker))).decode()
    doc["objects"]["obj"] = {"$pickle": evil}
    metadata_path(pickled).write_bytes(json.dumps(doc).encode())
    repin(pickled)
    with pytest.raises(unickpt.UnsafeObjectError, match="allow_pickle=True"):
        unickpt.load(pickled, {"w": torch.zeros(6), "obj": None, "plain": 0})
    assert not marker.exists(), "loading without allow_pickle ran code from the checkpoint"


def test_unsupported_object_without_allow_pickle_names_the_key(tmp_path: Path) -> None:
    state = {"model": {"w": torch.ones(2)}, "extra": {"thing": Opaque(1)}}
    with pytest.raises(unickpt.UnsafeObjectError) as info:
        unickpt.save(tmp_path / "c", state)
    message = str(info.value)
    assert "'extra.thing'" in message and "Opaque" in message
    assert "allow_pickle=True" in message and "state_dict" in message
    assert not (tmp_path / "c" / "COMMIT").exists()


def test_unpicklable_object_with_allow_pickle_names_the_key(tmp_path: Path) -> None:
    state = {"w": torch.ones(2), "hooks": {"on_step": lambda step: step}}
    with pytest.raises(unickpt.UnsafeObjectError, match=r"hooks\.on_step"):
        unickpt.save(tmp_path / "c", state, allow_pickle=True)


def _names_in_folder(doc: Any, names: set[str]) -> Iterator[tuple[Any, Any]]:
    """(container, slot) of every string in ``doc`` that names a file of the folder."""
    if isinstance(doc, dict):
        items: Any = doc.items()
    elif isinstance(doc, list):
        items = enumerate(doc)
    else:
        return
    for slot, value in list(items):
        if isinstance(value, str) and value in names:
            yield doc, slot
        else:
            yield from _names_in_folder(value, names)


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    path = tmp_path / "plain" / "ckpt"
    unickpt.save(path, _one_rank_state(), config=unickpt.get_config(**CONFIG))
    return path


def _load_plain(path: Path) -> dict[str, Any]:
    state = _blank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unickpt.load(path, state, strict=False, config=unickpt.get_config(**CONFIG))
    return state


NEWLINE = pytest.param(
    "{name}\n",
    id="trailing-newline",
)


@pytest.mark.parametrize("escape", ["../{name}", "/etc/passwd", "..", "sub/{name}", NEWLINE])
def test_metadata_file_names_cannot_leave_the_folder(plain: Path, escape: str) -> None:
    names = {p.name for p in plain.iterdir()}
    pristine = plain.parent / "pristine"
    shutil.copytree(plain, pristine)
    doc = read_metadata(plain)
    slots = list(_names_in_folder(doc, names))
    assert slots, "the metadata names no file of the folder"
    for i in range(len(slots)):
        shutil.rmtree(plain)
        shutil.copytree(pristine, plain)
        forged = copy.deepcopy(doc)
        container, slot = list(_names_in_folder(forged, names))[i]
        name = container[slot]
        # the file really exists where the forged name points: only the name check stops it
        shutil.copy(pristine / name, plain.parent / name)
        (plain / "sub").mkdir()
        shutil.copy(pristine / name, plain / "sub" / name)
        container[slot] = escape.format(name=name)
        metadata_path(plain).write_bytes(json.dumps(forged).encode())
        repin(plain)
        with pytest.raises(unickpt.CheckpointCorruptError) as info:
            _load_plain(plain)
        assert repr(escape.format(name=name)) in str(info.value)
        assert "outside its folder" in str(info.value)


@pytest.mark.parametrize("escape", ["../metadata.json", "/etc/passwd", "a/b.json"])
def test_commit_cannot_point_outside_the_folder(plain: Path, escape: str) -> None:
    record = read_commit(plain)
    shutil.copy(plain / record["metadata_file"], plain.parent / "metadata.json")
    record["metadata_file"] = escape
    (plain / "COMMIT").write_text(json.dumps(record))
    with pytest.raises(unickpt.CheckpointCorruptError, match="outside its folder"):
        _load_plain(plain)


def _index(folder: Path) -> Path:
    doc = read_metadata(folder)
    return folder / doc["files"][0]["index"]


def _forge_index(folder: Path, change: Any) -> None:
    path = _index(folder)
    doc = json.loads(path.read_bytes())
    change(doc)
    path.write_bytes(json.dumps(doc).encode())
    repin(folder)


def _chunk(doc: dict[str, Any], key: str) -> list[Any]:
    return next(c for c in doc["chunks"] if c[0] == key)


def _split_overlapping(doc: dict[str, Any], key: str) -> None:
    """Rows [0, 24) and [12, 36) of a 48-row chunk: as many elements as the tensor has, with
    rows 12-23 twice and rows 36-47 never (element counts cannot tell)."""
    chunk = _chunk(doc, key)
    half = chunk[4] // 2
    sums = chunk[5][: -(-len(chunk[5]) // 2)]  # the segments of half the bytes
    first = [key, [0, 0], [24, 64], chunk[3], half, sums]
    second = [key, [12, 0], [24, 64], chunk[3] + half, half, sums]
    doc["chunks"][doc["chunks"].index(chunk) : doc["chunks"].index(chunk) + 1] = [first, second]


def _set_value(path: tuple[Any, ...], value: Any) -> Any:
    def change(doc: dict[str, Any]) -> None:
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return change


_SEED = ("per_rank", "rng", 0, "$dict", "seed", "$tensor")
# name: (file forged, change, a phrase the error must hold)
FORGERIES = {
    "chunk beyond the tensor": (
        "index",
        lambda d: _chunk(d, "t.big")[1].__setitem__(0, 40),
        "'t.big' at [40, 0]",
    ),
    "chunk of an unknown key": (
        "index",
        lambda d: _chunk(d, "t.big").__setitem__(0, "t.nope"),
        "'t.nope'",
    ),
    "chunk bytes past the file end": (
        "index",
        lambda d: _chunk(d, "t.ids").__setitem__(3, 10**9),
        "truncated",
    ),
    "chunk dropped": (
        "index",
        lambda d: d["chunks"].remove(_chunk(d, "t.ids")),
        "'t.ids' (global shape [300]) do not tile it: elements [0:300] are held by no shard",
    ),
    "chunks overlapping, leaving a gap of the same size": (
        "index",
        lambda d: _split_overlapping(d, "t.big"),
        "'t.big' (global shape [48, 64]) do not tile it: elements [12:24, 0:64] are held by "
        "more than one shard; the metadata is damaged",
    ),
    "chunk listed twice": (
        "index",
        lambda d: d["chunks"].append(_chunk(d, "t.mask")),
        "'t.mask' (global shape [41]) do not tile it: elements [0:41] are held by more than one",
    ),
    "negative byte offset": ("index", lambda d: _chunk(d, "t.ids").__setitem__(3, -8), "-8"),
    "index of another format": (
        "index",
        lambda d: d.__setitem__("format", "other"),
        "format is 'other'",
    ),
    "file list emptied": (
        "metadata",
        _set_value(("files",), []),
        "chunks, more than the 0 indexes of 0 bytes can list; the metadata is damaged",
    ),
    "tensor dtype unknown": (
        "metadata",
        _set_value(("tensors", "t.big", "dtype"), "float99"),
        "float99",
    ),
    "value tag unknown": (
        "metadata",
        _set_value(("objects", "v.step"), {"$evil": 1}),
        "unknown tag '$evil'",
    ),
}
NOT_RAISED = pytest.fail.Exception
# name: (what went wrong once, the exception that showed it, the forgery)
FIXED_FORGERIES = {
    "chunk nbytes zero": (
        "a chunk whose nbytes is 0 (lengths say 300 int64) is accepted and nothing is read: the "
        "load succeeds and leaves the state's old values in place",
        NOT_RAISED,
        ("index", lambda d: _chunk(d, "t.ids").__setitem__(4, 0), "'t.ids'"),
    ),
    "0-d chunk with offsets": (
        "a chunk of a 0-d tensor with offsets [0] raises IndexError, not CheckpointCorruptError",
        IndexError,
        ("index", lambda d: _chunk(d, "t.scalar").__setitem__(1, [0]), "'t.scalar'"),
    ),
    "$dict payload not a dict": (
        "a value {'$dict': null} raises AttributeError, not CheckpointCorruptError",
        AttributeError,
        ("metadata", _set_value(_SEED[:4], None), "'rng'"),
    ),
    "$tensor shape disagrees with data": (
        "a value {'$tensor': ...} whose shape does not fit its data raises RuntimeError, not "
        "CheckpointCorruptError",
        RuntimeError,
        ("metadata", _set_value((*_SEED, "shape"), [2, 2]), "'rng"),
    ),
    "segment_bytes zero": (
        "the loader verifies with its own Config.segment_bytes and never reads the "
        "checkpoint's segment_bytes, so a metadata saying 0 loads without complaint",
        NOT_RAISED,
        ("metadata", _set_value(("segment_bytes",), 0), "segment_bytes"),
    ),
}


def _forge(folder: Path, where: str, change: Any) -> None:
    if where == "index":
        _forge_index(folder, change)
        return
    doc = read_metadata(folder)
    change(doc)
    metadata_path(folder).write_bytes(json.dumps(doc).encode())
    repin(folder)


def _params() -> list[Any]:
    out = [pytest.param(*forgery, id=name) for name, forgery in FORGERIES.items()]
    for name, (_, _, forgery) in FIXED_FORGERIES.items():
        out.append(pytest.param(*forgery, id=name))
    return out


@pytest.mark.parametrize(("where", "change", "phrase"), _params())
def test_forged_metadata_is_refused(plain: Path, where: str, change: Any, phrase: str) -> None:
    _forge(plain, where, change)
    with pytest.raises(unickpt.CheckpointError) as info:
        _load_plain(plain)
    assert phrase in str(info.value)


def _leaves(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if path:
        yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _leaves(v, (*path, i))


def _alternatives(value: Any) -> list[Any]:
    if isinstance(value, bool):
        return [not value, None]
    if isinstance(value, int):
        return [-1, 0, value + 1, "7", None]
    if isinstance(value, float):
        return [-1.0, None]
    if isinstance(value, str):
        return ["", "x", None]
    if isinstance(value, list):
        return [[], value[:-1], None]
    if isinstance(value, dict):
        return [{}, None, *({n: v for n, v in value.items() if n != k} for k in value)]
    return [0]


@pytest.mark.timeout(120)
def test_forged_field_by_field(plain: Path, tmp_path: Path) -> None:
    """Every field of the metadata and the index, replaced by wrong values, one at a time.

    A forged stored *value* can load as what it says (it is a well-formed checkpoint of other
    values); anything else must raise a CheckpointError or load exactly the saved values.
    """
    work = tmp_path / "work"
    shutil.copytree(plain, work)
    pristine = {p.name: p.read_bytes() for p in plain.iterdir()}
    outcomes: collections.Counter[str] = collections.Counter()
    failures = []
    for where in ("metadata", "index"):
        path = metadata_path(plain) if where == "metadata" else _index(plain)
        original = json.loads(path.read_bytes())
        for field, value in list(_leaves(original)):
            for other in _alternatives(value):
                for name, raw in pristine.items():
                    (work / name).write_bytes(raw)
                _forge(work, where, _set_value(field, other))
                try:
                    state = _load_plain(work)
                except unickpt.CheckpointError as e:
                    outcomes[type(e).__name__] += 1
                    continue
                except Exception as e:  # noqa: BLE001 - any other class is the failure looked for
                    failures.append(f"{where} {field} = {other!r}: {type(e).__name__}: {e}")
                    continue
                wrong = _wrong_values(state)
                if wrong and field[0] not in ("objects", "per_rank"):
                    failures.append(f"{where} {field} = {other!r}: wrong values {wrong}")
                outcomes["loaded"] += 1
    trials = sum(outcomes.values()) + len(failures)
    print(f"forged fields: {trials} trials, {dict(outcomes)}, {len(failures)} failures")
    assert not failures, "\n".join(failures)
