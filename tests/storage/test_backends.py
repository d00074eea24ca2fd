"""What every backend promises, checked on real files, fsspec's memory and fsspec's local files,
and S3 (a real moto server over HTTP)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from unickpt import CheckpointCorruptError, CheckpointError
from unickpt.storage import LocalStorage, Storage, open_storage
from unickpt.storage.fsspec import FsspecStorage

Make = Callable[[str], Storage]


@pytest.fixture(params=["local", "fsspec-memory", "fsspec-file", "s3"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """A factory of folders on one backend, under a fresh root."""
    tag = uuid.uuid4().hex[:8]
    if request.param == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        yield lambda name: open_storage(f"s3://{bucket}/t-{tag}/{name}")
        return
    makers: dict[str, Make] = {
        "local": lambda name: LocalStorage(tmp_path / name),
        "fsspec-memory": lambda name: FsspecStorage(f"memory://t-{tag}/{name}"),
        "fsspec-file": lambda name: FsspecStorage(f"file://{tmp_path}/{name}"),
    }
    yield makers[request.param]
    if request.param == "fsspec-memory":
        FsspecStorage("memory://").remove_tree(f"t-{tag}")


def _data(n: int, seed: int = 0) -> bytes:
    start = seed % 251
    return (bytes(range(251)) * (n // 251 + 2))[start : start + n]


def test_parts_from_many_threads_in_any_order(make: Make) -> None:
    s = make("c")
    part = max(4096, s.min_part_bytes)
    sizes = [part, part, part, 100]
    payload = _data(sum(sizes))
    h = s.create("data-x-00000.bin", sizes)
    order = [2, 3, 0, 1]

    def put(i: int) -> None:
        lo = sum(sizes[:i])
        part = memoryview(payload)[lo : lo + sizes[i]]
        h.write_part(i, [part[:7], part[7:7], part[7:]])  # several buffers, one empty

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(put, order))
    h.complete()
    assert s.size("data-x-00000.bin") == len(payload)
    out = bytearray(part + 2000)
    s.read_into("data-x-00000.bin", 3000, memoryview(out))
    assert bytes(out) == payload[3000 : part + 5000]
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        s.read_into("data-x-00000.bin", len(payload) - 10, memoryview(bytearray(20)))


def test_abort_leaves_nothing(make: Make) -> None:
    s = make("c")
    part = max(10, s.min_part_bytes)
    h = s.create("data-y-00000.bin", [part, 10])
    h.write_part(0, [memoryview(bytes(part))])
    h.abort()
    h.abort()
    assert s.size("data-y-00000.bin") is None
    assert "data-y-00000.bin" not in s.list_names()
    with pytest.raises(CheckpointError, match="aborted"):
        h.write_part(1, [memoryview(b"0123456789")])


def test_small_files_folders_and_removal(make: Make) -> None:
    root = make("root")
    assert root.list_names() == [] and root.read_bytes("COMMIT") is None
    step = root.child("step-000000001")
    step.write_atomic("COMMIT", b"x")
    step.write_atomic("COMMIT", b"yz")
    step.child("sub").write_atomic("f", b"1")
    root.write_atomic("notes", b"n")
    assert step.read_bytes("COMMIT") == b"yz" and step.size("COMMIT") == 2
    assert step.size("sub") is None, "a folder is not a file"
    assert [n for n in step.list_names() if not n.startswith(".")] == ["COMMIT", "sub"]
    assert root.list_names() == ["notes", "step-000000001"]
    step.remove("COMMIT")
    step.remove("COMMIT")
    assert step.read_bytes("COMMIT") is None
    root.remove_tree("step-000000001")
    root.remove_tree("step-000000001")
    assert root.list_names() == ["notes"]
    assert step.child("sub").read_bytes("f") is None


def test_location_opens_the_same_folder(make: Make) -> None:
    s = make("here")
    s.write_atomic("f", b"1")
    again = open_storage(s.location)
    assert again.read_bytes("f") == b"1"
    assert s.child("a").location == f"{s.location}/a"


def test_an_empty_file_is_one_empty_part(make: Make) -> None:
    s = make("c")
    h = s.create("empty", [0])
    h.write_part(0, [])
    h.complete()
    assert s.size("empty") == 0


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "..", "."])
def test_names_never_escape(make: Make, name: str) -> None:
    s = make("c")
    with pytest.raises(CheckpointCorruptError, match="not a plain file name"):
        s.write_atomic(name, b"x")
    with pytest.raises(CheckpointCorruptError, match="not a plain file name"):
        s.child(name)


def _in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, threading.Event, list[str]]:
    """Run ``fn`` in a thread; the event is set when it returns, errors are collected."""
    finished = threading.Event()
    errors: list[str] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - checked by the test
            errors.append(str(e))
        finished.set()

    t = threading.Thread(target=run)
    t.start()
    return t, finished, errors


def test_fsspec_holds_early_parts_within_its_bound() -> None:
    """Parts arriving early wait in memory up to the bound, then their writers wait their turn."""
    s = FsspecStorage(f"memory://bound-{uuid.uuid4().hex[:8]}", max_buffered_bytes=150)
    h = s.create("d", [100, 100, 100, 100])
    h.write_part(1, [memoryview(_data(100, 1))])  # held: 100 of 150 bytes
    t, finished, errors = _in_thread(lambda: h.write_part(2, [memoryview(_data(100, 2))]))
    assert not finished.wait(0.2), "a part over the bound must wait for its turn"
    h.write_part(0, [memoryview(_data(100, 0))])
    assert finished.wait(10) and not errors
    t.join()
    h.write_part(3, [memoryview(_data(100, 3))])
    h.complete()
    assert s.read_bytes("d") == b"".join(_data(100, i) for i in range(4))


def test_fsspec_abort_wakes_waiting_parts() -> None:
    s = FsspecStorage(f"memory://abort-{uuid.uuid4().hex[:8]}", max_buffered_bytes=0)
    h = s.create("e", [100, 100, 100])
    t, finished, errors = _in_thread(lambda: h.write_part(2, [memoryview(_data(100))]))
    assert not finished.wait(0.2)
    h.abort()
    assert finished.wait(10)
    t.join()
    assert errors and "aborted" in errors[0]
    assert s.size("e") is None
