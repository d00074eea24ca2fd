"""diff_checkpoints: identical, changed, added, reshaped, retyped and value differences."""

from __future__ import annotations

import math
from pathlib import Path

import torch

import unickpt
from unickpt.tools import diff_checkpoints
from unickpt.tools.diff import locate_difference

from .helpers import save_sample


def test_identical_checkpoints(tmp_path: Path) -> None:
    save_sample(tmp_path / "a")
    save_sample(tmp_path / "b")
    report = diff_checkpoints(tmp_path / "a", tmp_path / "b")
    assert report.identical
    assert report.tensors_compared > 10 and report.values_compared >= 4


def test_changed_tensor_in_row_blocks(tmp_path: Path) -> None:
    state = save_sample(tmp_path / "a")
    big = state["buffers"]["big"]
    big[200, 3] += 0.75
    big[5, 100] = big[5, 100] * 3
    unickpt.save(tmp_path / "b", state)
    report = diff_checkpoints(tmp_path / "a", tmp_path / "b", block_bytes=4096)
    (d,) = report.tensors
    assert (d.key, d.kind, d.differing) == ("buffers.big", "values", 2)
    original = big[5, 100].item() / 3
    expected_abs = max(0.75, abs(2 * original))
    assert math.isclose(d.max_abs, expected_abs, rel_tol=1e-6)
    assert d.max_rel is not None and 0 < d.max_rel <= 1
    assert not report.values


def test_tolerance_accepts_small_differences(tmp_path: Path) -> None:
    unickpt.save(tmp_path / "a", {"w": torch.ones(10)})
    unickpt.save(tmp_path / "b", {"w": torch.ones(10) + 1e-6})
    assert not diff_checkpoints(tmp_path / "a", tmp_path / "b").identical
    assert diff_checkpoints(tmp_path / "a", tmp_path / "b", atol=1e-5).identical


def test_structural_differences_and_values(tmp_path: Path) -> None:
    unickpt.save(
        tmp_path / "a",
        {
            "only_a": torch.ones(2),
            "shape": torch.ones(2, 3),
            "dtype": torch.ones(4),
            "nan": torch.tensor([float("nan"), 1.0]),
            "step": 1,
            "gone": "x",
        },
    )
    unickpt.save(
        tmp_path / "b",
        {
            "only_b": torch.ones(2),
            "shape": torch.ones(3, 2),
            "dtype": torch.ones(4).double(),
            "nan": torch.tensor([float("nan"), 1.0]),
            "step": 2,
            "new": "y",
        },
    )
    report = diff_checkpoints(tmp_path / "a", tmp_path / "b")
    kinds = {d.key: d.kind for d in report.tensors}
    assert kinds == {"only_a": "only_a", "only_b": "only_b", "shape": "shape", "dtype": "dtype"}
    dtype = next(d for d in report.tensors if d.key == "dtype")
    assert dtype.max_abs == 0.0
    values = {v.key: (v.kind, v.a, v.b) for v in report.values}
    assert values == {
        "step": ("values", "1", "2"),
        "gone": ("only_a", "'x'", None),
        "new": ("only_b", None, "'y'"),
    }


def test_sharded_against_single_process(tmp_path: Path, two_rank_checkpoint: Path) -> None:
    path = two_rank_checkpoint
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    full[6, 1] = -1.0
    unickpt.save(
        tmp_path / "one",
        {
            "model": {"w": full, "b": torch.ones(6)},
            "data_position": unickpt.PerRank(100),
            "step": 3,
        },
    )
    report = diff_checkpoints(path, tmp_path / "one", block_bytes=64)
    (d,) = report.tensors
    assert (d.key, d.max_abs, d.differing) == ("model.w", 38.0, 1)
    (v,) = report.values
    assert v.key == "data_position" and v.kind == "values"


def test_long_strings_show_where_they_differ(tmp_path: Path) -> None:
    """Two Lightning-like states in one JSON string: equal for 300 characters, so their short
    descriptions are equal; the report shows the first difference in a window."""
    head = '{"loops": {"fit_loop": {"epoch_progress": {"total": {"ready": ' + "1" * 40
    tail = ', "done": 1}, "rest": "' + "2" * 200 + '"}}}'
    unickpt.save(tmp_path / "a", {"state": head + "7" + tail, "same": "x"})
    unickpt.save(tmp_path / "b", {"state": head + "8" + tail, "same": "x"})
    (v,) = diff_checkpoints(tmp_path / "a", tmp_path / "b").values
    assert v.a == v.b  # what the table shows is the same on both sides
    assert v.offset == len(head)
    assert v.context_a == "..." + "1" * 24 + "[7]" + tail[:24] + "..."
    assert v.context_b == "..." + "1" * 24 + "[8]" + tail[:24] + "..."
    assert v.unified is None


def test_multi_line_texts_get_a_unified_diff() -> None:
    a = "".join(f"line {i}\n" for i in range(10))
    b = a.replace("line 5\n", "line five\n")
    offset, context_a, context_b, unified = locate_difference(a, b, context=4)
    assert offset == a.index("line 5") + 5
    assert (context_a, context_b) == ("...ine [5]\\nlin...", "...ine [f]ive\\n...")
    assert unified is not None
    assert unified.splitlines() == [
        "--- A",
        "+++ B",
        "@@ -4,5 +4,5 @@",
        " line 3",
        " line 4",
        "-line 5",
        "+line five",
        " line 6",
        " line 7",
    ]
    assert locate_difference("abc", "abcd") == (3, "abc[]", "abc[d]", None)
    assert locate_difference(None, "x") == (None, None, None, None)
