"""A writer killed with SIGKILL in the middle of a data file, on the local and the fsspec
backends (``file://``): nothing is under the file's name, before or after the kill, an
earlier file of that name stays whole, and listings never show the temporary file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from unickpt.storage import LocalStorage, Storage
from unickpt.storage.base import is_temp_name
from unickpt.storage.fsspec import FsspecStorage

NAME = "data-0123456789ab-00000.bin"
MiB = 1 << 20

_CHILD = """
import sys
from unickpt.storage.fsspec import FsspecStorage
from unickpt.storage.local import LocalStorage

kind, folder = sys.argv[1], sys.argv[2]
s = LocalStorage(folder) if kind == "local" else FsspecStorage("file://" + folder)
parts = 64
h = s.create({name!r}, [4 << 20] * parts)  # 256 MiB
for i in range(parts):
    h.write_part(i, [memoryview(bytes([i + 1]) * (4 << 20))])
    if i == 7:
        print("writing", flush=True)
        sys.stdin.readline()  # killed here, with 32 MiB of the file written
h.complete()
"""


def _storage(kind: str, folder: Path) -> Storage:
    return LocalStorage(folder) if kind == "local" else FsspecStorage(f"file://{folder}")


def _temp_files(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if is_temp_name(n))


@pytest.mark.parametrize("kind", ["local", "fsspec"])
def test_a_writer_killed_mid_file_leaves_nothing_under_its_name(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "ckpt"
    reader = _storage(kind, folder)
    reader.write_atomic(NAME, b"an earlier file of the same name")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(name=NAME), kind, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"writing"
        # mid-file: the bytes go to a temporary file that no reader sees
        (temp,) = _temp_files(folder)
        assert temp.startswith(f".{NAME}.") and temp.endswith(".part")
        assert (folder / temp).stat().st_size >= 32 * MiB
        assert reader.list_names() == [NAME]
        assert reader.read_bytes(NAME) == b"an earlier file of the same name"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert reader.list_names() == [NAME]
    assert reader.size(NAME) == len(b"an earlier file of the same name")
    assert reader.read_bytes(NAME) == b"an earlier file of the same name"
    assert _temp_files(folder) == [temp], "the dead writer's temporary file"
    if kind == "local":  # the next writer's lock removes it
        release = reader.acquire_lock()
        release()
        assert sorted(os.listdir(folder)) == ["LOCK", NAME]
    else:  # no lock: removing the folder as a whole does
        parent = reader.parent()
        assert parent is not None
        parent.remove_tree("ckpt")
        assert not folder.exists()


@pytest.mark.parametrize("kind", ["local", "fsspec"])
def test_an_unfinished_file_has_no_size_and_an_aborted_one_leaves_nothing(
    tmp_path: Path, kind: str
) -> None:
    s = _storage(kind, tmp_path)
    h = s.create(NAME, [3, 4])
    h.write_part(0, [memoryview(b"abc")])
    assert s.size(NAME) is None and s.read_bytes(NAME) is None and s.list_names() == []
    h.write_part(1, [memoryview(b"defg")])
    assert s.size(NAME) is None
    h.complete()
    assert s.size(NAME) == 7 and s.read_bytes(NAME) == b"abcdefg"
    h = s.create("other.bin", [3, 4])
    h.write_part(0, [memoryview(b"abc")])
    h.abort()
    assert s.list_names() == [NAME] and sorted(os.listdir(tmp_path)) == [NAME]
    s.write_atomic("small", b"1")
    assert s.list_names() == [NAME, "small"] and sorted(os.listdir(tmp_path)) == [NAME, "small"]
