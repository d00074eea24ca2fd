"""Row copies through NumPy: bitwise equal to ``Tensor.copy_`` for every layout they take, half
rows copied as overlapping longer rows included; when large copies may use torch's intra-op
threads."""

from __future__ import annotations

import os

import pytest
import torch

from unickpt.engine import memcpy
from unickpt.engine.memcpy import (
    copy_host_rows,
    copy_rows,
    copy_threads,
    host_rows,
    intra_op_fits,
)


def _source(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    if dtype == torch.bool:
        return torch.rand(12, 10, 16, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(12, 10, 16, generator=g).to(dtype)
    return torch.randint(-(2**15), 2**15, (12, 10, 16), generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_half_rows_of_a_strided_source(dtype: torch.dtype) -> None:
    src = _source(dtype)[2:9, :, 5:13]  # rows of 8 of 16 elements: strided, last dim contiguous
    dst = torch.zeros(src.shape, dtype=dtype)
    assert host_rows(src) is not None and host_rows(dst) is not None
    copy_rows(dst, src)
    assert torch.equal(dst, src)
    # Into a strided destination too (a column block of a wider tensor).
    wide = torch.zeros(7, 10, 20, dtype=dtype)
    copy_rows(wide[:, :, 4:12], src)
    assert torch.equal(wide[:, :, 4:12], src)
    assert not wide[:, :, :4].any() and not wide[:, :, 12:].any()


def test_layouts_numpy_does_not_take_fall_back_to_torch() -> None:
    src = _source(torch.float32)
    column = src[:, :, 3]  # last dimension strided
    dst = torch.zeros(column.shape)
    assert host_rows(column) is None
    copy_rows(dst, column)
    assert torch.equal(dst, column)
    scalar = torch.zeros(())
    copy_rows(scalar, src[1, 2, 3])
    assert scalar.item() == src[1, 2, 3].item()
    grad = torch.zeros(4, 16, requires_grad=True)  # parameters: copied without autograd
    with torch.no_grad():
        copy_rows(grad, src[0, :4])
    assert torch.equal(grad.detach(), src[0, :4])
    empty = torch.zeros(0, 16)
    copy_rows(empty, src[0, :0])
    assert empty.shape == (0, 16)


def test_intra_op_copies_only_where_every_rank_s_threads_fit_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert not intra_op_fits()  # one thread: nothing to split
        torch.set_num_threads(2)
        assert intra_op_fits() == (cores >= 2)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
        assert not intra_op_fits()  # 2 threads for each of `cores` ranks
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
        assert intra_op_fits() == (cores >= 2)  # unreadable: no process group, one rank
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        assert intra_op_fits() == (cores >= 2)
    finally:
        torch.set_num_threads(before)


def test_copy_threads_keep_a_rank_within_its_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert copy_threads(4) == min(4, cores)
    assert copy_threads(1) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))  # more ranks than cores: one each
    assert copy_threads(4) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert copy_threads(64) == max(1, cores // 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # unknown: the process counts as alone
    assert copy_threads(64) == cores


@pytest.fixture
def fast_short_rep_movsb(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the overlapping copies whatever this processor announces, to check them anywhere."""
    monkeypatch.setattr(memcpy, "_fast_short_rep_movsb", lambda: True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("row_bytes", [3072, 2560])  # source rows twice the part's, and less
@pytest.mark.usefixtures("fast_short_rep_movsb")
def test_half_rows_copied_as_overlapping_rows_land_exactly(
    dtype: torch.dtype, row_bytes: int
) -> None:
    """Half rows of a saved chunk into a ``Shard(1)`` shard: each row copied with the source up
    to the next row, overwritten by the next row's copy; right values, nothing written past the
    rows asked for, from both halves and in blocks of rows (as the owner of a unit copies)."""
    size = torch.tensor([], dtype=dtype).element_size()
    part, width = 1536 // size, row_bytes // size
    full = torch.randint(-(2**15), 2**15, (9, width), dtype=torch.int64).to(dtype)
    for lo in (0, width - part):  # the left half rows, and the right ones (reads reach row + 1)
        src = full[:, lo : lo + part]
        for rows in (slice(0, 9), slice(0, 2), slice(3, 8)):
            guarded = torch.full((11, part), 7, dtype=dtype)
            dst = guarded[1:10][rows]
            d, s = host_rows(dst), host_rows(src[rows])
            assert d is not None and s is not None and memcpy._overlaps_pay(d, s)
            copy_host_rows(d, s)
            assert torch.equal(dst, src[rows])
            untouched = torch.ones(11, dtype=torch.bool)
            untouched[1 + (rows.start or 0) : 1 + rows.stop] = False
            assert (guarded[untouched] == 7).all()


@pytest.mark.usefixtures("fast_short_rep_movsb")
def test_rows_the_overlapping_copy_does_not_pay_for_are_copied_plainly() -> None:
    """Long rows (glibc already copies them with ``rep movsb``), source rows more than twice
    the part apart (the copy would write past the destination), sources too short for the
    threshold, destinations whose rows are not back to back, one row, a source in the
    destination's memory, and 3-D parts."""
    base = torch.randn(6, 4096)
    cases = {
        "long rows": (torch.zeros(6, 1024), base[:, :1024]),
        "more than twice": (torch.zeros(6, 384), base[:, :384]),
        "short source rows": (torch.zeros(6, 256), base[:, :512].contiguous()[:, :256]),
        "strided destination": (torch.zeros(6, 800)[:, :384], base[:, :768][:, :384]),
        "one row": (torch.zeros(1, 384), base[:1, :768][:, :384]),
    }
    for name, (dst, src) in cases.items():
        d, s = host_rows(dst), host_rows(src)
        assert d is not None and s is not None
        assert not memcpy._overlaps_pay(d, s), name
        copy_host_rows(d, s)
        assert torch.equal(dst, src), name
    cube = torch.randn(3, 4, 768)
    d, s = host_rows(torch.zeros(3, 4, 384)), host_rows(cube[:, :, :384])
    assert d is not None and s is not None and not memcpy._overlaps_pay(d, s)
    flat = torch.randn(12 * 768)  # rows of the source overwritten by the copy itself
    src, dst = flat.view(12, 768)[:6, :384], flat[768 : 768 + 6 * 384].view(6, 384)
    want = src.clone()
    d, s = host_rows(dst), host_rows(src)
    assert d is not None and s is not None and not memcpy._overlaps_pay(d, s)
    copy_host_rows(d, s)
    assert torch.equal(dst, want)


def test_numpy_copies_overlapping_items_in_ascending_order() -> None:
    """The overlapping copy relies on it; the check that guards it holds here."""
    assert memcpy._ascending_overlaps()
