from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from unickpt import CheckpointLockedError
from unickpt.storage import LocalStorage
from unickpt.storage.local import _os_error, fs_type, make_folder, pwritev_all


def test_pwritev_of_more_buffers_than_one_call_takes(tmp_path: Path) -> None:
    pieces = [bytes([i % 256]) * (1 + i % 5) for i in range(3000)]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        pwritev_all(fd, [memoryview(p) for p in pieces], 7)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"\0" * 7 + b"".join(pieces)


def test_parts_land_at_their_offsets(tmp_path: Path) -> None:
    s = LocalStorage(tmp_path / "c")
    h = s.create("d", [3, 4, 2])
    h.write_part(2, [memoryview(b"89")])
    h.write_part(0, [memoryview(b"01"), memoryview(b"2")])
    h.write_part(1, [memoryview(bytearray(b"4567"))[:0], memoryview(b"3456")])
    h.complete()
    assert (tmp_path / "c" / "d").read_bytes() == b"012345689"


def test_ranges_map_without_a_copy_and_writes_stay_private(tmp_path: Path) -> None:
    data = bytes(range(256)) * 64  # 16 KiB: ranges start off the page boundary
    (tmp_path / "d").write_bytes(data)
    s = LocalStorage(tmp_path)
    view = s.map_range("d", 5000, 7000)
    assert view is not None and bytes(view) == data[5000:12000]
    view[0] ^= 0xFF
    assert (tmp_path / "d").read_bytes() == data
    assert s.map_range("d", 10000, 6385) is None  # one byte past the end: read instead
    assert bytes(s.map_range("d", 0, 16384) or b"") == data
    s.close()


def test_new_folders_and_their_parents_are_made(tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b" / "c"
    make_folder(deep)
    make_folder(deep)
    assert deep.is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        make_folder(tmp_path / "file")
    s = LocalStorage(tmp_path / "x" / "y").child("step-000000001")
    s.write_atomic("COMMIT", b"1")
    assert (tmp_path / "x" / "y" / "step-000000001" / "COMMIT").read_bytes() == b"1"
    assert not LocalStorage(tmp_path / "file").list_names()
    assert LocalStorage(tmp_path / "file").is_file()


def test_lock_is_exclusive(tmp_path: Path) -> None:
    release = LocalStorage(tmp_path).acquire_lock()
    with pytest.raises(CheckpointLockedError, match="is being written by pid"):
        LocalStorage(tmp_path).acquire_lock()
    release()
    LocalStorage(tmp_path).acquire_lock()()


def test_the_file_system_of_a_folder_is_known_before_it_exists(tmp_path: Path) -> None:
    assert fs_type(Path("/proc/self")) == "proc"
    assert fs_type(tmp_path / "not" / "yet") == fs_type(tmp_path)
    if fs_type(Path("/dev/shm")) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    assert LocalStorage("/dev/shm/unickpt-none/step-1").in_memory
    assert not LocalStorage("/proc/self").in_memory


def test_a_full_disk_promises_no_checkpoint_that_may_not_exist() -> None:
    message = str(_os_error(OSError(errno.ENOSPC, "No space left on device", "/x/d"), "writing"))
    assert message == (
        "writing failed: No space left on device (/x/d); the disk is full: free space or save "
        "elsewhere; an earlier committed checkpoint, if any, is untouched."
    )
