"""The read path: pieces cut on the checksum segments of the checkpoint being read; small
chunks read together."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.config import MiB, get_config
from unickpt.engine.load import RankReads
from unickpt.engine.read_chunks import BATCH_SPAN_BYTES, SMALL_CHUNK_BYTES, aligned_piece_bytes
from unickpt.errors import CheckpointCorruptError
from unickpt.storage import LocalStorage
from unickpt.storage.local import fs_type


def test_pieces_are_whole_segments_of_the_checkpoint() -> None:
    assert aligned_piece_bytes(64 * MiB, 1 * MiB) == 64 * MiB
    assert aligned_piece_bytes(64 * MiB, 3 * MiB) == 63 * MiB
    assert aligned_piece_bytes(64 * MiB, 96 * MiB) == 96 * MiB  # never less than a segment
    assert aligned_piece_bytes(65536, 12288) == 61440


def test_a_checkpoint_with_other_segments_loads_with_the_default_config(tmp_path: Path) -> None:
    """3 MiB segments do not divide the reader's 64 MiB pieces; a chunk of 70 MiB spans two."""
    writer = get_config(segment_bytes=3 * MiB, window_bytes=63 * MiB, read_piece_bytes=63 * MiB)
    big = torch.randint(-(2**31), 2**31 - 1, (70 * MiB // 4,), dtype=torch.int32)
    state = {"big": big, "small": torch.arange(10.0)}
    unickpt.save(tmp_path / "c", state, config=writer)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    unickpt.load(tmp_path / "c", dest)  # the default config: 64 MiB pieces, verified
    assert torch.equal(dest["big"], big) and torch.equal(dest["small"], state["small"])
    # A region of the chunk (another layout): read through a buffer, segment by segment.
    start, n = 3 * MiB // 4 + 5, 16 * MiB // 4
    part = unickpt.ShardedTensor(torch.zeros(n, dtype=torch.int32), big.shape, (start,))
    unickpt.load(tmp_path / "c", {"big": part})
    assert torch.equal(part.local, big[start : start + n])


class _CountingReads(LocalStorage):
    """A checkpoint folder on disk that counts the reads of data files made through it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reads: list[tuple[str, int, int]] = []

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        if name.startswith("data-"):
            self.reads.append((name, offset, len(out)))
        super().read_into(name, offset, out)


def test_small_neighbouring_chunks_are_read_together(tmp_path: Path) -> None:
    """300 small tensors (norms, biases, steps) and a large one: the small ones come in a few
    reads of their spans, each checked and copied into place; damage to one of them names it."""
    g = torch.Generator().manual_seed(0)
    state = {f"n{i}": torch.randn(1 + i % 97, generator=g) for i in range(300)}
    state["mid"] = torch.randn(SMALL_CHUNK_BYTES // 4 + 1, generator=g)  # above the batch bound
    state["big"] = torch.randn(3 * MiB, generator=g)
    unickpt.save(tmp_path / "c", state)  # 1 MiB checksum segments: big is read in 12
    storage = _CountingReads(tmp_path / "c")
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    report = unickpt.load(storage, dest, config=get_config(read_piece_bytes=1 * MiB))
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    small = sum(v.numel() * 4 for k, v in state.items() if k.startswith("n"))
    assert len(storage.reads) <= 2 + 1 + 12  # the small ones in one or two, mid, big
    assert report.bytes_wanted <= report.bytes_read <= report.bytes_wanted + 64 * 300
    assert small < report.bytes_read - (len(state["big"]) + len(state["mid"])) * 4 + 1

    saved = LocalStorage(tmp_path / "c")
    hit = next(r for r in RankReads(saved, dest).plan(saved) if r.key == "n150")
    with open(tmp_path / "c" / hit.file, "r+b") as f:  # one byte of n150, mid-batch
        f.seek(hit.chunk.byte_offset + 5)
        byte = f.read(1)
        f.seek(hit.chunk.byte_offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointCorruptError, match="holding tensor 'n150'"):
        unickpt.load(tmp_path / "c", {k: torch.zeros_like(v) for k, v in state.items()})


def test_a_read_of_small_chunks_together_spans_at_most_the_batch_bound(tmp_path: Path) -> None:
    """240 tensors just under the small-chunk bound (15 MB): read in a few reads, each no longer
    than BATCH_SPAN_BYTES (its buffer is kept per thread for the load), all values exact."""
    g = torch.Generator().manual_seed(1)
    n = SMALL_CHUNK_BYTES // 4 - 16
    state = {f"t{i}": torch.randn(n, generator=g) for i in range(240)}
    unickpt.save(tmp_path / "c", state)
    storage = _CountingReads(tmp_path / "c")
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    unickpt.load(storage, dest)
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    sizes = [size for _, _, size in storage.reads]
    assert max(sizes) <= BATCH_SPAN_BYTES
    assert len(sizes) <= 2 * (240 * n * 4) // BATCH_SPAN_BYTES + 2  # batched, not one per tensor


@pytest.fixture
def shm_path() -> Iterator[Path]:
    """A folder in host shared memory (a tmpfs), as the memory tier's node folders are."""
    if fs_type(Path("/dev/shm")) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    path = Path(tempfile.mkdtemp(prefix="unickpt-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_files_in_memory_are_copied_out_of_maps_and_verified(shm_path: Path) -> None:
    """Whole chunks of a checkpoint in a tmpfs are copied out of a map of the file (no read
    call), each segment checked: bit for bit; damage names its tensor and bytes; a small chunk
    and the last short piece of a chunk still go through reads."""
    g = torch.Generator().manual_seed(2)
    state = {
        "big": torch.randn(3 * MiB + 77, generator=g),  # 12 MiB + 308 B: a short last segment
        "odd": torch.randint(0, 255, (5 * MiB + 3,), dtype=torch.uint8, generator=g),
        "small": torch.randn(10, generator=g),
    }
    unickpt.save(shm_path / "c", state)
    storage = _CountingReads(shm_path / "c")
    assert storage.in_memory
    config = get_config(read_piece_bytes=4 * MiB)  # "big" in 4 MiB pieces, the last 308 B
    for verify in (True, False):
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        report = unickpt.load(
            storage, dest, config=get_config(**{**config.__dict__, "verify": verify})
        )
        assert all(torch.equal(dest[k], v) for k, v in state.items())
        assert report.bytes_read == report.bytes_wanted
    assert all(n < MiB for _, _, n in storage.reads), storage.reads  # only small pieces read

    saved = LocalStorage(shm_path / "c")
    hit = next(r for r in RankReads(saved, state).plan(saved) if r.key == "big")
    at = hit.chunk.byte_offset + 5 * MiB + 9  # inside the sixth segment of "big"
    with open(shm_path / "c" / hit.file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    lo = hit.chunk.byte_offset + 5 * MiB
    with pytest.raises(
        CheckpointCorruptError, match=rf"bytes \[{lo}, {lo + MiB}\) holding tensor 'big'"
    ):
        unickpt.load(storage, dest, config=config)
    unickpt.load(storage, dest, config=get_config(verify=False))  # not checked: loads as it is
    changed = (dest["big"] != state["big"]).nonzero().flatten().tolist()
    assert changed == [(5 * MiB + 9) // 4]


class _Unmappable(_CountingReads):
    """A folder in memory whose files cannot be mapped (no address space left for them)."""

    def map_range(self, name: str, offset: int, length: int) -> memoryview | None:
        return None


def test_files_in_memory_that_cannot_be_mapped_are_read(shm_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(2 * MiB + 5, generator=g), "small": torch.arange(7.0)}
    unickpt.save(shm_path / "c", state)
    storage = _Unmappable(shm_path / "c")
    assert storage.in_memory
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    unickpt.load(storage, dest)
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    assert sum(n for _, _, n in storage.reads) >= state["big"].numel() * 4  # read, not mapped
