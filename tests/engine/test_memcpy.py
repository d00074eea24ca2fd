"""Host copies through NumPy: bitwise equal to ``Tensor.copy_`` for every layout and dtype they
take, parts of rows included; when large copies may use torch's intra-op threads."""

from __future__ import annotations

import os

import pytest
import torch

from unickpt.engine.memcpy import copy_elements, copy_threads, elements, intra_op_fits


def _source(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    if dtype == torch.bool:
        return torch.rand(12, 10, 16, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(12, 10, 16, generator=g).to(dtype)
    return torch.randint(-(2**15), 2**15, (12, 10, 16), generator=g, dtype=dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
def test_parts_of_rows_land_bit_for_bit_and_nothing_else_is_written(dtype: torch.dtype) -> None:
    """Half rows of a saved chunk into a ``Shard(1)`` shard, a column block into a wider
    tensor, a strided last dimension: the values bit for bit, every other element untouched."""
    src = _source(dtype)[2:9, :, 5:13]  # rows of 8 of 16 elements: strided
    assert elements(src) is not None
    dst = torch.zeros(src.shape, dtype=dtype)
    copy_elements(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.contiguous().view(torch.uint8))
    wide = torch.zeros(7, 10, 20, dtype=dtype)
    copy_elements(wide[:, :, 4:12], src)
    assert torch.equal(wide[:, :, 4:12].view(torch.uint8), src.contiguous().view(torch.uint8))
    assert (
        not wide[:, :, :4].view(torch.uint8).any() and not wide[:, :, 12:].view(torch.uint8).any()
    )
    column = _source(dtype)[:, :, 3]  # last dimension strided
    out = torch.zeros(column.shape, dtype=dtype)
    copy_elements(out, column)
    assert torch.equal(out.view(torch.uint8), column.contiguous().view(torch.uint8))


def test_what_numpy_does_not_take_falls_back_to_torch() -> None:
    src = _source(torch.float32)
    scalar = torch.zeros(())
    copy_elements(scalar, src[1, 2, 3])
    assert scalar.item() == src[1, 2, 3].item()
    grad = torch.zeros(4, 16, requires_grad=True)  # parameters: copied without autograd
    with torch.no_grad():
        copy_elements(grad, src[0, :4])
    assert torch.equal(grad.detach(), src[0, :4])
    empty = torch.zeros(0, 16)
    copy_elements(empty, src[0, :0])
    assert empty.shape == (0, 16)
    z = torch.randn(3, 4, dtype=torch.complex64)  # a conjugate view NumPy cannot take
    assert elements(z.conj()) is None
    out = torch.zeros(3, 4, dtype=torch.complex64)
    copy_elements(out, z.conj())
    assert torch.equal(out, z.conj())
    halves = torch.zeros(2, 8, dtype=torch.float16)  # dtypes apart: torch converts
    copy_elements(halves, src[0, :2, :8])
    assert torch.equal(halves, src[0, :2, :8].half())


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
