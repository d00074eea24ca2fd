"""Fused, Padded and Replicated leaves and the layout= helpers in one process: the checks made
up front, what flattening makes of them, and a save and load round trip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.checkpointer import open_checkpoint
from unickpt.planning.flatten import flatten_state


def _glu(local: torch.Tensor) -> unickpt.Fused:
    return unickpt.Fused(
        local, dim=0, pieces=[("gate", (4, 3), (0, 0), 2), ("up", (4, 3), (2, 0), 2)]
    )


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        ([("gate", (4, 3), (0, 0), 2)], "the pieces' lengths sum to 2 but the local tensor has 4"),
        (
            [("gate", (4, 3), (3, 0), 2), ("up", (4, 3), (0, 0), 2)],
            "does not lie inside its global_shape (4, 3)",
        ),
        (
            [("gate", (4, 3), (0, 0), 2), ("gate", (6, 3), (4, 0), 2)],
            "pieces of 'gate' give global shapes (4, 3) and (6, 3)",
        ),
        ([("gate", (4,), (0,), 2), ("up", (4,), (0,), 2)], "one size and one offset per dimension"),
        ([("gate", (4, 3), (0, 0))], "is not (name, global_shape, offsets, length)"),
    ],
)
def test_fused_refuses_inconsistent_pieces(pieces: list, message: str) -> None:
    with pytest.raises(unickpt.CheckpointError, match=re.escape(message)):
        unickpt.Fused(torch.zeros(4, 3), dim=0, pieces=pieces)


def test_padded_and_replicated_refuse_what_they_cannot_hold() -> None:
    with pytest.raises(
        unickpt.CheckpointError, match=r"\(12, 4\) does not fit in the padded shape \(10, 4\)"
    ):
        unickpt.Padded(torch.zeros(10, 4), (12, 4))
    with pytest.raises(unickpt.CheckpointError, match="Padded: the leaf is a FlatShard"):
        unickpt.Padded(unickpt.FlatShard(torch.zeros(4), (2, 2), 0), (2, 2))
    with pytest.raises(unickpt.CheckpointError, match="expected 'check'"):
        unickpt.Replicated(torch.zeros(2), "max")
    with pytest.raises(unickpt.CheckpointError, match="a mean needs a floating dtype"):
        unickpt.Replicated(torch.zeros(2, dtype=torch.int64), "mean")


def test_helpers_check_their_sizes() -> None:
    with pytest.raises(unickpt.CheckpointError, match="make 16 rows along dim 0"):
        unickpt.fused_qkv(0, 2, num_query_groups=4, heads_per_group=2, head_dim=2)(
            torch.zeros(15, 3)
        )
    with pytest.raises(unickpt.CheckpointError, match="do not split over tp_size 3"):
        unickpt.fused_qkv(0, 3, num_query_groups=4, heads_per_group=2, head_dim=2)
    with pytest.raises(unickpt.CheckpointError, match="need an even size"):
        unickpt.fused_glu(0, 2)(torch.zeros(5, 3))
    with pytest.raises(unickpt.CheckpointError, match="expected 0 <= tp_rank < tp_size"):
        unickpt.fused_glu(2, 2)


def test_layout_errors_name_the_key_and_pattern() -> None:
    state = {"m": {"fc1": torch.zeros(5, 3)}}
    with pytest.raises(
        unickpt.CheckpointError, match=r"'m.fc1' \(layout pattern '\*fc1'\): fused_glu"
    ):
        flatten_state(state, layout={"*fc1": unickpt.fused_glu(0, 1)})
    with pytest.raises(unickpt.CheckpointError, match="expected a dict of key patterns"):
        flatten_state(state, layout=[("*fc1", unickpt.fused_glu(0, 1))])  # type: ignore[arg-type]
    with pytest.raises(unickpt.CheckpointError, match="expected a string pattern"):
        flatten_state(state, layout={"*fc1": "glu"})  # type: ignore[dict-item]


def test_fused_flattens_to_views_of_each_global_tensor() -> None:
    local = torch.arange(12.0).reshape(4, 3)
    flat = flatten_state({"m": {"fc1": _glu(local)}})
    assert sorted(flat.tensors) == ["m.fc1.gate", "m.fc1.up"]
    names = flat.keys()
    assert "m.fc1" not in names
    ((box, view),) = flat.tensors["m.fc1.up"].pieces
    assert box.offsets == (2, 0) and box.lengths == (2, 3)
    view.fill_(-1.0)  # a view: what a load writes lands in the local tensor
    assert (local[2:] == -1).all() and torch.equal(local[:2], torch.arange(6.0).reshape(2, 3))
    with pytest.raises(unickpt.CheckpointError, match=r"flatten to the key 'm\.fc1\.gate'"):
        flatten_state({"m": {"fc1": _glu(local), "fc1.gate": torch.zeros(2)}})


def test_padded_saves_only_the_logical_region(tmp_path: Path) -> None:
    emb = torch.cat([torch.arange(20.0).reshape(5, 4), torch.full((3, 4), 9.0)])
    unickpt.save(tmp_path / "c", {"emb": unickpt.Padded(emb, (5, 4))})
    plain = torch.zeros(5, 4)
    unickpt.load(tmp_path / "c", {"emb": plain})
    assert torch.equal(plain, emb[:5])
    wider = torch.full((6, 6), -2.0)  # padded along both dimensions
    unickpt.load(tmp_path / "c", {"emb": unickpt.Padded(wider, (5, 4))})
    assert torch.equal(wider[:5, :4], emb[:5])
    assert (wider[5:] == -2).all() and (wider[:, 4:] == -2).all()


def test_fused_round_trip_with_a_layout_map_is_strict(tmp_path: Path) -> None:
    """Saved fused, loaded strictly into the same fused layout: the fused key itself is not
    asked for, its pieces are."""
    qkv = torch.randn(2 * (2 * 3 + 2 * 3), 5)  # 2 query groups of 2 heads, head_dim 3
    layout = {
        "*.linear_qkv.weight": unickpt.fused_qkv(0, 1, 2, 2, 3),
        "*.ln": unickpt.replicated("mean"),
    }
    ln = torch.randn(5)
    unickpt.save(tmp_path / "c", {"model": {"a.linear_qkv.weight": qkv, "a.ln": ln}}, layout=layout)
    back = {"model": {"a.linear_qkv.weight": torch.zeros_like(qkv), "a.ln": torch.zeros(5)}}
    unickpt.load(tmp_path / "c", back, layout=layout)
    assert torch.equal(back["model"]["a.linear_qkv.weight"], qkv)
    assert torch.equal(back["model"]["a.ln"], ln)
    q = torch.zeros(12, 5)
    k = torch.zeros(6, 5)
    v = torch.zeros(6, 5)
    names = {"a.linear_qkv.weight.q": q, "a.linear_qkv.weight.k": k, "a.linear_qkv.weight.v": v}
    unickpt.load(tmp_path / "c", {"model": {**names, "a.ln": torch.zeros(5)}})
    assert torch.equal(q, torch.cat([qkv[0:6], qkv[12:18]]))
    assert torch.equal(k, torch.cat([qkv[6:9], qkv[18:21]]))
    assert torch.equal(v, torch.cat([qkv[9:12], qkv[21:24]]))


def test_zero_stall_save_of_fused_padded_and_replicated_leaves(tmp_path: Path) -> None:
    """zero_stall=True: the leaves (and a layout map) are captured at the call and
    the pieces checked against the versions recorded for the tensors they are views of."""
    local = torch.randn(1000, 64)  # large enough to be kept by reference, not copied
    emb = torch.randn(600, 64)
    state = {
        "m": {
            "fc1": unickpt.Fused(
                local,
                dim=0,
                pieces=[("gate", (500, 64), (0, 0), 500), ("up", (500, 64), (0, 0), 500)],
            ),
            "emb": unickpt.Padded(emb, (500, 64)),
            "ln": unickpt.Replicated(torch.ones(3), "mean"),
            "qkv": local.clone(),
        }
    }
    layout = {"*.qkv": unickpt.fused_glu(0, 1)}
    unickpt.async_save(tmp_path / "c", state, zero_stall=True, layout=layout).wait()
    back = {k: torch.zeros(500, 64) for k in ("fc1.gate", "fc1.up", "qkv.gate", "qkv.up", "emb")}
    unickpt.load(tmp_path / "c", {"m": {**back, "ln": torch.zeros(3)}})
    assert torch.equal(back["fc1.gate"], local[:500]) and torch.equal(back["qkv.up"], local[500:])
    assert torch.equal(back["emb"], emb[:500])


def test_replicated_tensor_tied_to_an_earlier_key_is_saved_once(tmp_path: Path) -> None:
    t = torch.arange(4.0)
    unickpt.save(tmp_path / "c", {"a": t, "b": unickpt.Replicated(t, "mean")})
    back = {"a": torch.zeros(4), "b": torch.zeros(4)}
    unickpt.load(tmp_path / "c", back)
    assert torch.equal(back["a"], t) and torch.equal(back["b"], t)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_checkpointer_saves_and_resumes_with_its_layout_map(
    tmp_path: Path, async_save: bool
) -> None:
    """Checkpointer(layout=...): every save stores the pieces, load_latest fills the fused
    tensor back through the same map, and an unfused state loads the pieces by name."""
    layout = {"*.fc1": unickpt.fused_glu(0, 1)}
    fc1 = torch.randn(8, 3)
    with unickpt.Checkpointer(
        tmp_path / "run", layout=layout, mode="async" if async_save else "sync"
    ) as ckpt:
        ckpt.save(1, {"m": {"fc1": fc1}}).wait()
        back = {"m": {"fc1": torch.zeros(8, 3)}}
        assert ckpt.load_latest(back) == 1
    assert torch.equal(back["m"]["fc1"], fc1)
    gate, up = torch.zeros(4, 3), torch.zeros(4, 3)
    unickpt.load(open_checkpoint(tmp_path / "run", 1), {"m": {"fc1.gate": gate, "fc1.up": up}})
    assert torch.equal(gate, fc1[:4]) and torch.equal(up, fc1[4:])
