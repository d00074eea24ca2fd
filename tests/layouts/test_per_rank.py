"""PerRank values resharded by their own function when the world size changes.

One spawned run of 3 ranks saves, then loads on the same 3 ranks and on a group of 2 of them:
the function gets the saved values in rank order, the ranks that held none are named in a
warning, the same world size gives each rank its own value without calling the function, and an
error of the function fails the load on every loading rank with the key named.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

import unickpt
from tests.distributed import run_ranks
from unickpt.engine.commit import read_metadata
from unickpt.storage.local import LocalStorage


def _seen(saved: list[Any], world_size: int, rank: int) -> dict[str, Any]:
    return {"saved": saved, "world_size": world_size, "rank": rank}


def _never(saved: list[Any], world_size: int, rank: int) -> Any:
    raise AssertionError("called at the saved world size with every rank's value")


def _bad_split(saved: list[Any], world_size: int, rank: int) -> Any:
    raise ValueError(f"cannot split {len(saved)} positions over {world_size} ranks")


def _attempt(fn: Callable[[], Any]) -> tuple[str, str, list[str]]:
    """(error class or "ok", message, warnings) of a call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the outcome is what the tests check
            return type(e).__name__, str(e), [str(w.message) for w in caught]
    return "ok", "", [str(w.message) for w in caught]


def _saved_state(rank: int, how: Any) -> dict[str, Any]:
    state: dict[str, Any] = {
        "pos": unickpt.PerRank({"rank": rank, "offset": 10 * rank}, on_world_change=how)
    }
    if rank != 1:
        state["gappy"] = unickpt.PerRank(f"value of rank {rank}", on_world_change=how)
    return state


def _load(
    path: str, key: str, how: Any, group: Any = None
) -> tuple[Any, tuple[str, str, list[str]]]:
    holder = unickpt.PerRank("current", on_world_change=how)
    outcome = _attempt(lambda: unickpt.load(path, {key: holder}, group=group))
    return holder.value, outcome


def _cases(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    unickpt.save(f"{root}/fn", _saved_state(rank, _seen))
    unickpt.save(f"{root}/warn", _saved_state(rank, "warn"))
    if rank == 0:
        fn, warn = (read_metadata(LocalStorage(f"{root}/{n}"))[1] for n in ("fn", "warn"))
        out["same format"] = fn.per_rank == warn.per_rank
    out["same world"] = _load(f"{root}/fn", "pos", _never)
    out["rank missing"] = _load(f"{root}/fn", "gappy", _seen)
    out["fails"] = _load(f"{root}/fn", "gappy", _bad_split)
    two = dist.new_group([0, 1])  # every rank makes it; ranks 0 and 1 load as a world of 2
    if rank < 2:
        out["two ranks"] = _load(f"{root}/fn", "pos", _seen, two)
        out["two ranks, rank missing"] = _load(f"{root}/fn", "gappy", _seen, two)
        out["two ranks, warn"] = _load(f"{root}/warn", "pos", "warn", two)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(3, _cases, str(tmp_path_factory.mktemp("per_rank")))


def test_the_saved_format_does_not_depend_on_the_function(results: list[dict[str, Any]]) -> None:
    assert results[0]["same format"] is True


def test_same_world_size_gives_each_rank_its_own_value(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        value, (kind, message, caught) = r["same world"]
        assert (kind, message, caught) == ("ok", "", [])
        assert value == {"rank": rank, "offset": 10 * rank}


def test_the_function_gets_every_saved_value_in_rank_order(results: list[dict[str, Any]]) -> None:
    saved = [{"rank": r, "offset": 10 * r} for r in range(3)]
    for rank, r in enumerate(results[:2]):
        value, (kind, _, caught) = r["two ranks"]
        assert (kind, caught) == ("ok", [])
        assert value == {"saved": saved, "world_size": 2, "rank": rank}


def test_ranks_that_held_no_value_are_left_out_and_named(results: list[dict[str, Any]]) -> None:
    saved = ["value of rank 0", "value of rank 2"]
    for name, world in (("rank missing", 3), ("two ranks, rank missing", 2)):
        for rank, r in enumerate(results[:world]):
            value, (kind, _, caught) = r[name]
            assert kind == "ok"
            assert value == {"saved": saved, "world_size": world, "rank": rank}
            assert caught == [
                "'gappy': saving rank 1 of 3 held no value; its PerRank function resharded the "
                f"values of the others over {world} loading ranks."
            ]


def test_a_failing_function_fails_the_load_with_the_key_named(
    results: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(results):
        value, (kind, message, _) = r["fails"]
        assert value == "current"
        assert kind == "DistributedCheckpointError"
        assert message.startswith("loading failed on 3 of 3 ranks:")
        assert (
            f"'gappy': its PerRank on_world_change function _bad_split failed on rank {rank} of "
            "3 with the values of 2 of 3 saving ranks: ValueError: cannot split 2 positions over "
            "3 ranks. Fix the function, or load on the saved world size."
        ) in message


def test_warn_keeps_its_behaviour(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results[:2]):
        value, (kind, _, caught) = r["two ranks, warn"]
        assert kind == "ok"
        assert value == {"rank": rank, "offset": 10 * rank}
        assert len(caught) == 1 and "saved by 3 ranks" in caught[0]


def test_on_world_change_takes_a_function_or_warn_or_error() -> None:
    with pytest.raises(unickpt.CheckpointError, match="or a function fn\\(saved_values"):
        unickpt.PerRank(1, on_world_change="ignore")
