import pytest
import torch

from unickpt.engine.memcpy import LARGE_COPY_BYTES
from unickpt.engine.snapshot import snapshot
from unickpt.layouts.boxes import Box
from unickpt.planning.save_plan import WriteItem


def _items(views: list[torch.Tensor]) -> list[WriteItem]:
    items, offset = [], 0
    for i, v in enumerate(views):
        items.append(WriteItem(f"t{i}", Box((0,) * v.dim(), tuple(v.shape)), offset, v.nbytes))
        offset += v.nbytes
    return items


def _room(views: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty(sum(v.nbytes for v in views), dtype=torch.uint8)


def _views() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(LARGE_COPY_BYTES // 4 + 5, generator=g)
    wide = torch.randn(64, LARGE_COPY_BYTES // 128, generator=g)
    return [
        big,  # large, contiguous
        wide.t(),  # large, not contiguous
        torch.randn(3, 7, generator=g),  # small
        torch.arange(100, dtype=torch.int64),  # small, another dtype
        torch.randn(LARGE_COPY_BYTES // 2 - 1, generator=g).to(torch.bfloat16),  # just below
    ]


@pytest.mark.parametrize("intra_op", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_item_lands_bitwise_and_is_checked_once(intra_op: bool, threads: int) -> None:
    views = _views()
    checked: list[int] = []
    sources = snapshot(_items(views), views, _room(views), threads, checked.append, intra_op)
    assert sorted(checked) == list(range(len(views)))
    for src, v in zip(sources, views):
        assert src.view.dtype == v.dtype and src.view.shape == v.shape
        assert torch.equal(src.view.view(torch.uint8), v.contiguous().view(torch.uint8))
        v.add_(1)  # the snapshot is a copy
        assert not torch.equal(src.view, v)


@pytest.mark.parametrize("intra_op", [False, True])
def test_a_failing_check_stops_the_snapshot_with_its_error(intra_op: bool) -> None:
    views = _views()

    def check(i: int) -> None:
        if i == 1:
            raise RuntimeError("tensor 't1' changed while it was copied")

    with pytest.raises(RuntimeError, match="tensor 't1' changed while it was copied"):
        snapshot(_items(views), views, _room(views), 2, check, intra_op)
