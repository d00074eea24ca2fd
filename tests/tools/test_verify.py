"""verify_checkpoint on an intact checkpoint and after each kind of damage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unickpt.engine.tensor_reader import CheckpointReader
from unickpt.errors import CheckpointNotFoundError
from unickpt.format.metadata import COMMIT_FILE
from unickpt.tools import inspect_checkpoint, verify_checkpoint

from .helpers import save_sample


def _data_file(path: Path) -> Path:
    (data,) = sorted(path.glob("data-*.bin"))
    return data


def _metadata_file(path: Path) -> Path:
    return path / json.loads((path / COMMIT_FILE).read_text())["metadata_file"]


def _chunk_of(path: Path, key: str) -> tuple[int, int]:
    with CheckpointReader(path) as reader:
        (chunk,) = reader.metadata.tensors[key].chunks
    return chunk.byte_offset, chunk.nbytes


def test_intact_checkpoint_passes(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    report = verify_checkpoint(tmp_path / "c", piece_bytes=4096)
    assert report.ok, report.damage
    assert report.files == 1
    # Every payload byte is checked; only alignment padding between chunks is not.
    assert report.bytes_verified == inspect_checkpoint(tmp_path / "c").tensor_bytes
    padding = _data_file(tmp_path / "c").stat().st_size - report.bytes_verified
    assert 0 <= padding < 64 * report.chunks
    assert report.chunks > 10 and report.segments >= report.chunks - 1


def test_flipped_byte_names_file_tensor_and_range(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    offset, nbytes = _chunk_of(tmp_path / "c", "buffers.big")
    data = _data_file(tmp_path / "c")
    raw = bytearray(data.read_bytes())
    raw[offset + 1000] ^= 0x01
    data.write_bytes(bytes(raw))
    report = verify_checkpoint(tmp_path / "c")
    assert not report.ok
    (damage,) = report.damage
    assert (damage.file, damage.key) == (data.name, "buffers.big")
    assert damage.start == offset and damage.stop == offset + nbytes  # one segment: the chunk
    assert "checksum mismatch" in damage.message and data.name in damage.message
    assert f"[{offset}, {offset + nbytes})" in damage.message


def test_truncated_data_file(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    data = _data_file(tmp_path / "c")
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 10)
    report = verify_checkpoint(tmp_path / "c")
    assert not report.ok
    messages = [d.message for d in report.damage]
    assert any(
        f"has {size - 10} bytes, expected {size}" in m and "truncated" in m for m in messages
    )
    last = [d for d in report.damage if d.key is not None]
    assert last and all(d.stop is not None and d.stop > size - 10 for d in last)


def test_deleted_data_file(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    data = _data_file(tmp_path / "c")
    data.unlink()
    report = verify_checkpoint(tmp_path / "c")
    (damage,) = report.damage
    assert damage.file == data.name
    assert "is missing" in damage.message
    assert report.bytes_verified == 0


def test_damaged_metadata(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    meta = _metadata_file(tmp_path / "c")
    raw = bytearray(meta.read_bytes())
    raw[len(raw) // 2] ^= 0x20
    meta.write_bytes(bytes(raw))
    report = verify_checkpoint(tmp_path / "c")
    (damage,) = report.damage
    assert damage.file == meta.name
    assert "checksum" in damage.message and "metadata is damaged" in damage.message


def test_damaged_index(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    (index,) = sorted((tmp_path / "c").glob("index-*.json"))
    index.write_text(index.read_text().replace("buffers.big", "buffers.bog"))
    (damage,) = verify_checkpoint(tmp_path / "c").damage
    assert damage.file == index.name
    assert index.name in damage.message


def test_damaged_commit_marker(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    (tmp_path / "c" / COMMIT_FILE).write_text("{not json")
    (damage,) = verify_checkpoint(tmp_path / "c").damage
    assert damage.file == COMMIT_FILE


def test_no_checkpoint_raises(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        verify_checkpoint(tmp_path / "nothing")


def test_multi_segment_damage_is_merged(tmp_path: Path) -> None:
    import torch

    import unickpt
    from unickpt.config import get_config

    cfg = get_config(segment_bytes=4096, window_bytes=65536, read_piece_bytes=65536)
    unickpt.save(tmp_path / "c", {"w": torch.randn(64, 1024)}, config=cfg)
    data = _data_file(tmp_path / "c")
    raw = bytearray(data.read_bytes())
    for pos in (5000, 9000, 13000, 100_000):
        raw[pos] ^= 0xFF
    data.write_bytes(bytes(raw))
    report = verify_checkpoint(tmp_path / "c", piece_bytes=8192)
    ranges = [(d.start, d.stop) for d in report.damage]
    assert ranges == [(4096, 16384), (98304, 102400)]
    assert report.segments == 64
