from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.errors import CheckpointError


def _state(value: float) -> dict[str, object]:
    return {"w": torch.full((64,), value), "train": {"step": int(value)}}


def test_steps_retention_and_latest(tmp_path: Path) -> None:
    with unickpt.Checkpointer(tmp_path, keep_last=2) as ckpt:
        for step in range(5):
            ckpt.save(step, _state(step))
        ckpt.wait()
        assert ckpt.steps() == [3, 4]
        dest = _state(-1)
        assert ckpt.load_latest(dest) == 4
        assert torch.equal(dest["w"], torch.full((64,), 4.0))  # type: ignore[arg-type]
        assert ckpt.path(4).endswith("step-000000004")


def test_falls_back_over_damaged_and_ignores_uncommitted(tmp_path: Path) -> None:
    ckpt = unickpt.Checkpointer(tmp_path, mode="sync")
    for step in (1, 2, 3):
        ckpt.save(step, _state(step))
    (Path(ckpt.path(3)) / "COMMIT").unlink()
    data = next(Path(ckpt.path(2)).glob("data-*.bin"))
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0x5A
    data.write_bytes(bytes(raw))
    assert ckpt.steps() == [1, 2]
    dest = _state(-1)
    with pytest.warns(UserWarning, match="checksum mismatch"):
        assert ckpt.load_latest(dest) == 1
    assert torch.equal(dest["w"], torch.full((64,), 1.0))  # type: ignore[arg-type]
    ckpt.save(4, _state(4))
    assert not os.path.exists(ckpt.path(3)), "an interrupted save's folder is debris"
    ckpt.close()


def test_empty_root_and_second_job(tmp_path: Path) -> None:
    ckpt = unickpt.Checkpointer(tmp_path / "new")
    assert ckpt.load_latest(_state(0)) is None and ckpt.steps() == []
    assert not (tmp_path / "new").exists(), "a reader creates nothing"
    ckpt.save(1, _state(1)).wait()
    with pytest.raises(unickpt.CheckpointLockedError, match="two jobs"):
        unickpt.Checkpointer(tmp_path / "new").save(2, _state(2))
    ckpt.close()
    with unickpt.Checkpointer(tmp_path / "new", mode="sync") as again:
        again.save(2, _state(2))
        assert again.steps() == [1, 2]
    with pytest.raises(unickpt.CheckpointError, match="keep_last is 0"):
        unickpt.Checkpointer(tmp_path / "x", keep_last=0)


def test_readers_never_lock(tmp_path: Path) -> None:
    with unickpt.Checkpointer(tmp_path, mode="sync") as writer:
        writer.save(3, _state(3))
    assert unickpt.Checkpointer(tmp_path).path(3).endswith("step-000000003")
    dest = _state(-1)
    assert unickpt.Checkpointer(tmp_path).load_latest(dest) == 3
    assert torch.equal(dest["w"], torch.full((64,), 3.0))  # type: ignore[arg-type]
    with unickpt.Checkpointer(tmp_path, mode="sync") as writer:
        reader = unickpt.Checkpointer(tmp_path)
        writer.save(4, _state(4))
        assert reader.steps() == [3, 4] and reader.load_latest(dest) == 4


def test_close_saves_the_last_step_a_loop_left_unsaved(tmp_path: Path) -> None:
    state = {"w": torch.zeros(3), "step": 0}
    for total, saved in ((6, [0, 3, 5]), (7, [0, 3, 6])):
        ckpt = unickpt.Checkpointer(tmp_path / f"run{total}")
        for step in range(total):
            state["w"].add_(1.0)
            state["step"] = step
            if step % 3 == 0:
                ckpt.save(step, state)
        ckpt.close(final_step=total - 1, state=state)
        assert ckpt.steps() == saved
        back = {"w": torch.zeros(3), "step": -1}
        assert unickpt.Checkpointer(tmp_path / f"run{total}").load_latest(back) == total - 1
        assert back["step"] == total - 1 and torch.equal(back["w"], state["w"])
        state["w"].zero_()
    with pytest.raises(CheckpointError, match="final_step and state together"):
        unickpt.Checkpointer(tmp_path / "x").close(final_step=3)


@pytest.mark.parametrize(
    ("flags", "mode"),
    [
        ({"async_save": False}, "sync"),
        ({"async_save": True}, "async"),
        ({"background_snapshot": True}, "zero_stall"),
        ({"async_save": True, "background_snapshot": False}, "async"),
    ],
)
def test_the_former_save_flags_still_work_and_name_mode(
    tmp_path: Path, flags: dict[str, bool], mode: str
) -> None:
    with pytest.warns(DeprecationWarning, match=f"pass mode='{mode}' instead"):
        ckpt = unickpt.Checkpointer(tmp_path, **flags)  # type: ignore[arg-type]
    with ckpt:
        assert ckpt.mode == mode
        ckpt.save(1, _state(1)).wait()
        dest = _state(-1)
        assert ckpt.load_latest(dest) == 1
    assert torch.equal(dest["w"], torch.full((64,), 1))  # type: ignore[arg-type]


def test_a_mode_is_checked_and_must_agree_with_the_former_flags(tmp_path: Path) -> None:
    with pytest.raises(unickpt.CheckpointError, match="mode is 'fast'; expected one of"):
        unickpt.Checkpointer(tmp_path, mode="fast")
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(unickpt.CheckpointError, match="disagree; pass mode only"),
    ):
        unickpt.Checkpointer(tmp_path, mode="zero_stall", async_save=False)
