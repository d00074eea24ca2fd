from __future__ import annotations

from pathlib import Path

import pytest

from unickpt import CheckpointCorruptError, CheckpointLockedError
from unickpt.storage import LocalStorage, check_name


def test_write_read_atomic_and_ranges(tmp_path: Path) -> None:
    s = LocalStorage(tmp_path / "c")
    h = s.create("data-00-00000.bin", 10)
    h.write_at(5, memoryview(b"world"))
    h.write_at(0, memoryview(b"hello"))
    h.close()
    out = bytearray(5)
    s.read_into("data-00-00000.bin", 5, memoryview(out))
    assert out == b"world"
    s.write_atomic("COMMIT", b"x")
    s.write_atomic("COMMIT", b"y")
    assert s.read_bytes("COMMIT") == b"y"
    assert [n for n in s.list_names() if n.endswith(".tmp")] == []
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        s.read_into("data-00-00000.bin", 8, memoryview(bytearray(5)))
    s.close()


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "..", ".", ""])
def test_names_never_escape(name: str) -> None:
    with pytest.raises(CheckpointCorruptError, match="not a plain file name"):
        check_name(name)


def test_lock_is_exclusive(tmp_path: Path) -> None:
    release = LocalStorage(tmp_path).acquire_lock()
    with pytest.raises(CheckpointLockedError, match="is being written by pid"):
        LocalStorage(tmp_path).acquire_lock()
    release()
    LocalStorage(tmp_path).acquire_lock()()
