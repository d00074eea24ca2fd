"""Damage anywhere in a committed checkpoint is caught: a CheckpointError, or exact values.

Every file of a checkpoint (saved by one rank and by two) gets, one at a time: one byte
flipped at many positions, truncation at several lengths, emptied, deleted, a byte appended.
After each, ``unickpt.load`` (verifying checksums, the default) must raise a CheckpointError
whose message says what is wrong, or load exactly the saved values; then the file is restored.
"""

from __future__ import annotations

import collections
import math
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from tests.distributed import run_ranks
from tests.integrity._helpers import bits

# Small checksum segments, so a tensor spans several; loads use the same settings (see
# test_checkpoint_saved_with_another_segment_size_loads for why they must, for now).
SEGMENT = 4096
CONFIG = dict(segment_bytes=SEGMENT, window_bytes=4 * SEGMENT, read_piece_bytes=4 * SEGMENT)
MAX_FLIPS_PER_FILE = 160
# Words a damage message uses to say what is wrong; each message must hold one of them.
EXPLAINS = ("damaged", "truncated", "missing", "incomplete", "not a unickpt", "checksum", "version")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    half = torch.randn(17, 3, generator=g).to(torch.float16)
    half[0, 0], half[1, 1], half[2, 2] = float("nan"), float("inf"), float("-inf")
    return {
        "big": torch.randn(48, 64, generator=g),
        "ids": torch.randint(-(2**40), 2**40, (300,), generator=g),
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "half": half,
        "mask": torch.rand(41, generator=g) > 0.5,
        "scalar": torch.tensor(2.718281828459045, dtype=torch.float64),
        "empty": torch.empty(0, 5),
    }


def _values() -> dict[str, Any]:
    return {
        "step": 1234,
        "name": "run-å/β",
        "nested": {"lr": [0.1, 0.01], "flags": (True, None), "raw": b"\x00\xff"},
        "nan": float("nan"),
    }


def _rank_value(rank: int) -> Any:
    return {"rank": rank, "seed": torch.tensor([rank * 7 + 1, 99], dtype=torch.int64)}


def _one_rank_state() -> dict[str, Any]:
    return {
        "t": _tensors(),
        "v": _values(),
        "rng": unickpt.PerRank(_rank_value(0)),
    }


def _two_rank_state(rank: int) -> dict[str, Any]:
    t = _tensors()
    big = t["big"]
    flat = t["ids"]
    n = flat.numel() // 2 + 13
    return {
        "t": {
            **t,
            "big": unickpt.ShardedTensor(
                big[rank * 24 : (rank + 1) * 24], (48, 64), (rank * 24, 0)
            ),
            "ids": unickpt.FlatShard(
                flat[:n].clone() if rank == 0 else flat[n:].clone(), (300,), 0 if rank == 0 else n
            ),
        },
        "v": _values(),
        "rng": unickpt.PerRank(_rank_value(rank)),
    }


def _save_two_ranks(rank: int, world: int, path: str) -> None:
    unickpt.save(path, _two_rank_state(rank), config=unickpt.get_config(**CONFIG))


def _blank() -> dict[str, Any]:
    """A state of the saved structure holding none of the saved values."""
    return {
        "t": {k: torch.full_like(v, 3) for k, v in _tensors().items()},
        "v": {
            "step": "unset",
            "name": "unset",
            "nested": {"lr": ["unset", "unset"], "flags": "unset", "raw": "unset"},
            "nan": "unset",
        },
        "rng": unickpt.PerRank("unset"),
    }


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bits(a) == bits(b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_value, a, b))
    return type(a) is type(b) and a == b


def _wrong_values(state: dict[str, Any]) -> list[str]:
    """Keys whose loaded value differs from the saved one (bitwise for tensors)."""
    wrong = [k for k, v in _tensors().items() if not _same_value(state["t"][k], v)]
    wrong += [k for k, v in _values().items() if not _same_value(state["v"][k], v)]
    if not _same_value(state["rng"].value, _rank_value(0)):
        wrong.append("rng")
    return wrong


def _load_outcome(folder: Path) -> str:
    """``"ok"`` (exact values), or the class of the CheckpointError raised; else a failure."""
    state = _blank()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            unickpt.load(folder, state, strict=False, config=unickpt.get_config(**CONFIG))
    except unickpt.CheckpointError as e:
        message = str(e)
        if not any(word in message for word in EXPLAINS):
            raise AssertionError(f"unclear message: {type(e).__name__}: {message}") from e
        return type(e).__name__
    except Exception as e:
        raise AssertionError(f"not a CheckpointError: {type(e).__name__}: {e}") from e
    wrong = _wrong_values(state)
    if wrong:
        raise AssertionError(f"loaded without error but with wrong values: {wrong}")
    return "ok"


Damage = tuple[str, Callable[[bytes], bytes | None]]


def _damages(raw: bytes, rng: random.Random) -> Iterator[Damage]:
    """Every damage tried on one file: a function from its bytes to the damaged bytes."""
    n = len(raw)
    if n <= MAX_FLIPS_PER_FILE:
        positions = list(range(n))
    else:
        step = n / (MAX_FLIPS_PER_FILE - 40)
        positions = sorted(
            {int(i * step) for i in range(MAX_FLIPS_PER_FILE - 40)}
            | {rng.randrange(n) for _ in range(38)}
            | {0, n - 1}
        )
    for i, pos in enumerate(positions):
        mask = (0x01, 0x80, 0xFF, 0x20)[i % 4]
        yield (
            f"byte {pos} ^ {mask:#04x}",
            lambda b, p=pos, m=mask: b[:p] + bytes([b[p] ^ m]) + b[p + 1 :],
        )
    cuts = {0, 1, n // 2, n - 1, *(rng.randrange(n) for _ in range(4))} if n else {0}
    for cut in sorted(c for c in cuts if c < n):
        yield f"truncated to {cut} bytes", lambda b, c=cut: b[:c]
    yield "one byte appended", lambda b: b + b"\x00"
    yield "deleted", lambda b: None


def _run_damage_trials(pristine: Path, work: Path, rng: random.Random) -> collections.Counter[str]:
    shutil.copytree(pristine, work)
    assert _load_outcome(work) == "ok"
    outcomes: collections.Counter[str] = collections.Counter()
    per_file: dict[str, collections.Counter[str]] = {}
    failures = []
    names = sorted(p.name for p in pristine.iterdir())
    for name in names:
        raw = (pristine / name).read_bytes()
        seen = per_file[name] = collections.Counter()
        for what, damage in _damages(raw, rng):
            target = work / name
            damaged = damage(raw)
            if damaged is None:
                target.unlink()
            else:
                target.write_bytes(damaged)
            try:
                seen[_load_outcome(work)] += 1
            except AssertionError as e:
                failures.append(f"{name}, {what}: {e}")
            target.write_bytes(raw)
        outcomes += seen
    for name in names:
        assert (work / name).read_bytes() == (pristine / name).read_bytes()
    assert sorted(p.name for p in work.iterdir()) == names
    trials = sum(outcomes.values()) + len(failures)
    print(f"{pristine.name}: {trials} damage trials over {len(names)} files: {dict(outcomes)}")
    for name, seen in per_file.items():
        print(f"  {name}: {dict(seen)}")
    assert not failures, f"{len(failures)} of {trials} trials failed:\n" + "\n".join(failures[:40])
    return outcomes


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("damage") / "one-rank"
    unickpt.save(path, _one_rank_state(), config=unickpt.get_config(**CONFIG))
    return path


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("damage") / "two-ranks"
    run_ranks(2, _save_two_ranks, str(path))
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["one_rank", "two_ranks"])
def test_damage_is_caught_or_harmless(
    which: str, request: pytest.FixtureRequest, tmp_path: Path, rng: random.Random
) -> None:
    pristine: Path = request.getfixturevalue(which)
    if which == "two_ranks":
        assert len(list(pristine.glob("data-*"))) == 2
    outcomes = _run_damage_trials(pristine, tmp_path / "work", rng)
    assert outcomes["CheckpointCorruptError"] > 0


def test_checkpoint_saved_with_another_segment_size_loads(one_rank: Path) -> None:
    """The trials above load with the saving config; a default reader must load it too."""
    state = _blank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unickpt.load(one_rank, state, strict=False)
    assert _wrong_values(state) == []
