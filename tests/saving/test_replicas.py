"""Replicated(reduce="check"): copies identical bit for bit pass, infinities and NaNs
included; copies that differ in any bit are refused on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import unickpt

from ..distributed import run_ranks


def _special() -> dict[str, torch.Tensor]:
    """Tensors holding infinities and NaNs, of dtypes of 1, 2, 4, 8 and 16 bytes."""
    f = torch.tensor([1.0, float("inf"), float("-inf"), float("nan"), -0.0])
    return {
        "f32": f.clone(),
        "bf16": f.to(torch.bfloat16),
        "f64": f.to(torch.float64),
        "c128": torch.complex(f.double(), f.flip(0).double()),
        "f8": f.to(torch.float8_e5m2),
        "big": torch.tensor([2**60, -(2**62)]),
    }


def _check_cases(rank: int, world: int, path: str) -> dict[str, Any]:
    """Each case saves one replicated key; each rank reports the save's error, if any."""
    same = {k: unickpt.Replicated(v, "check") for k, v in _special().items()}
    unickpt.save(f"{path}/same", {"m": same})
    loaded = {k: torch.zeros_like(v) for k, v in _special().items()}
    unickpt.load(f"{path}/same", {"m": loaded})
    bitwise = all(
        torch.equal(loaded[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8))
        for k, v in _special().items()
    )
    cases = {
        "nan elsewhere": torch.tensor([1.0, float("nan") if rank else 2.0, 3.0]),
        "inf against a number": torch.tensor([float("inf") if rank else 5.0, 0.0]),
        "signed zero": torch.tensor([0.0, -0.0 if rank else 0.0]),
        "int64 beyond 2**53": torch.tensor([7, 2**60 + rank]),
        "by 0.25": torch.tensor([1.0, 2.0 + 0.25 * rank]),
    }
    errors = {}
    for name, value in cases.items():
        try:
            unickpt.save(f"{path}/{name}", {"m": {"w": unickpt.Replicated(value, "check")}})
            errors[name] = ""
        except unickpt.CheckpointError as e:
            errors[name] = f"{type(e).__name__}: {e}"
    return {"bitwise": bitwise, "errors": errors}


def test_identical_copies_pass_and_any_bit_of_difference_is_refused(tmp_path: Path) -> None:
    results = run_ranks(2, _check_cases, str(tmp_path))
    expected = {
        "nan elsewhere": "differs (a NaN, or an infinity, in some copies only)",
        "inf against a number": "differs by up to inf",
        "signed zero": "differs in its bits, not as float64 values",
        "int64 beyond 2**53": "differs in its bits, not as float64 values",
        "by 0.25": "differs by up to 0.25",
    }
    elements = {"nan elsewhere": "(1,)", "inf against a number": "(0,)", "signed zero": "(1,)"}
    elements |= {"int64 beyond 2**53": "(1,)", "by 0.25": "(1,)"}
    for r in results:
        assert r["bitwise"]
        for name, says in expected.items():
            error = r["errors"][name]
            assert error.startswith("CheckpointMismatchError: Replicated(reduce='check'): "), name
            assert f"'m.w' {says}" in error, (name, error)
            assert "between the copies of ranks 0, 1" in error, (name, error)
            assert f"(at element {elements[name]})" in error, (name, error)
            assert not (tmp_path / name / "COMMIT").exists()
