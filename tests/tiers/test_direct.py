"""How ranges of a file travel into the state: messages cut alike on both sides, reads served."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unickpt.tiers.direct import Message, Targets, messages


def test_large_ranges_go_in_pieces_and_small_ones_together() -> None:
    ranges = [(0, 10), (16, 0), (16, 5), (40, 100), (140, 3), (200, 3), (300, 3)]
    assert messages(ranges, piece=40) == [
        Message(0, 21, (0, 2)),  # small ranges with the gap between them; the empty one: none
        Message(40, 80, (3,)),  # a large range in pieces of at most 40 bytes
        Message(80, 120, (3,)),
        Message(120, 140, (3,)),
        Message(140, 143, (4,)),  # 140..203 would span more than a piece
        Message(200, 203, (5,)),
        Message(300, 303, (6,)),
    ]


def test_received_bytes_land_in_their_tensors_and_serve_reads() -> None:
    file = torch.arange(64, dtype=torch.uint8)
    big, small1, small2 = (torch.zeros(n, dtype=torch.uint8) for n in (20, 3, 4))
    path = Path("/m/data-0.bin")
    targets = Targets({path: [(30, big), (2, small1), (8, small2)]})
    assert targets.ranges(path) == [(2, 3), (8, 4), (30, 20)]
    scratch = torch.empty(64, dtype=torch.uint8)
    for m in messages(targets.ranges(path), piece=8):
        targets.receive(
            path, m, lambda x, m=m: x.copy_(file[m.start : m.end]), lambda n: scratch[:n]
        )
    assert torch.equal(big, file[30:50])
    assert torch.equal(small1, file[2:5]) and torch.equal(small2, file[8:12])
    out = bytearray(4)
    targets.serve(path, 9, memoryview(out)[:3])  # elsewhere: copied
    assert bytes(out[:3]) == bytes(file[9:12].tolist())
    targets.serve(path, 30, memoryview(big.numpy())[:20])  # where it landed: nothing to do
    both = bytearray(b"\xff" * 10)  # small1 and small2 read together, 3 bytes apart
    targets.serve(path, 2, memoryview(both))
    assert both == bytes(file[2:5].tolist()) + b"\xff" * 3 + bytes(file[8:12].tolist())
    with pytest.raises(RuntimeError) as e:
        targets.serve(path, 12, memoryview(out)[:2])
    assert str(e.value) == (
        f"a load read bytes [12, 14) of {path}, which was fetched for the chunks it was "
        "planned to read only; this is a bug in unickpt."
    )
