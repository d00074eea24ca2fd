"""Scenarios every backend other than local files runs: a Checkpointer root (retention, an
interrupted save's folder, the command line) and the resharding matrix across spawned ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import unickpt
from tests.api.layouts_zoo import LAYOUTS, global_tensors, local_of, zeroed
from unickpt.cli.main import main
from unickpt.config import Config
from unickpt.storage import Storage, open_storage

SAVE_LAYOUTS = ("dt_row", "megatron", "flat", "replicated")
LOAD_LAYOUTS = ("dt_col", "flat", "replicated")

State = dict[str, Any]


def async_and_refused_saves(
    url: str,
    bad_url: str,
    make: Callable[[int], State],
    blank: Callable[[], State],
    same: Callable[[State, State], None],
    config: Config,
) -> None:
    """An asynchronous save loads back; a second save without overwrite is refused; a save of
    an unsafe object into ``bad_url`` fails (the caller checks that nothing stays there)."""
    state = make(2)
    unickpt.async_save(url, state, config=config).wait()
    with pytest.raises(unickpt.CheckpointExistsError):
        unickpt.save(url, make(3), config=config)
    dest = blank()
    unickpt.load(url, dest)
    same(dest, state)
    with pytest.raises(unickpt.UnsafeObjectError):
        unickpt.save(bad_url, {**make(4), "o": object()}, config=config)


def checkpointer_and_command_line(
    root: str,
    make: Callable[[int], State],
    blank: Callable[[], State],
    same: Callable[[State, State], None],
    config: Config,
    capsys: pytest.CaptureFixture[str],
    leave_debris: Callable[[Storage], None] | None = None,
) -> Storage:
    """Steps 0-3 kept 2; a folder an interrupted save left (``leave_debris`` adds to it) is
    ignored, then removed by the next save; inspect, verify and diff on the root."""
    with unickpt.Checkpointer(root, keep_last=2, config=config) as ckpt:
        for step in range(4):
            ckpt.save(step, make(step))
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
        assert ckpt.path(3) == f"{open_storage(root).location}/step-000000003"
    storage = open_storage(root)
    storage.child("step-000000009").write_atomic("data-x-00000.bin", b"partial")
    if leave_debris is not None:
        leave_debris(storage.child("step-000000009"))
    reader = unickpt.Checkpointer(root)
    assert reader.steps() == [2, 3]
    dest = blank()
    assert reader.load_latest(dest) == 3
    same(dest, make(3))
    with unickpt.Checkpointer(root, keep_last=2, mode="sync", config=config) as ckpt:
        ckpt.save(4, make(4))
    assert storage.list_names() == ["ROOT_ID", "step-000000003", "step-000000004"]
    # the command line takes the newest committed step of a root, or --step N
    assert main(["inspect", root]) == 0
    assert "step-000000004" in capsys.readouterr().out
    assert main(["verify", root, "--step", "3"]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {storage.location}/step-000000003")
    assert main(["diff", root, root, "--step", "4"]) == 0
    assert main(["diff", root, f"{storage.location}/step-000000003"]) == 1
    capsys.readouterr()
    return storage


def save_layouts(
    rank: int, world: int, root: str, config: Config, big: torch.Tensor | None = None
) -> None:
    """Every small tensor in every save layout (and ``big`` row-sharded) at ``root/layouts``;
    steps 1 and 2 of a Checkpointer at ``root/run`` keeping 1."""
    tensors = global_tensors()
    state: State = {
        lay: {n: LAYOUTS[lay](t, rank, world) for n, t in tensors.items()} for lay in SAVE_LAYOUTS
    }
    if big is not None:
        state["big"] = LAYOUTS["dt_row"](big, rank, world)
    unickpt.save(f"{root}/layouts", state, config=config)
    with unickpt.Checkpointer(f"{root}/run", keep_last=1, config=config) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": LAYOUTS["dt_row"](tensors["a"] * step, rank, world)})


def load_layouts(
    rank: int, world: int, root: str, config: Config, big: torch.Tensor | None = None
) -> tuple[list[str], int, int]:
    """Load what :func:`save_layouts` wrote into every load layout; what came out wrong, and
    the bytes read and needed."""
    tensors = global_tensors()
    wrong = []
    read = wanted = 0
    for dest_layout in LOAD_LAYOUTS:
        make = LAYOUTS[dest_layout]
        state: State = {
            lay: {n: zeroed(make(t, rank, world)) for n, t in tensors.items()}
            for lay in SAVE_LAYOUTS
        }
        if big is not None:
            state["big"] = zeroed(make(big, rank, world))
        report = unickpt.load(f"{root}/layouts", state, config=config)
        read, wanted = read + report.bytes_read, wanted + report.bytes_wanted
        for lay in SAVE_LAYOUTS:
            for n, t in tensors.items():
                if not torch.equal(local_of(state[lay][n]), local_of(make(t, rank, world))):
                    wrong.append(f"{lay} -> {dest_layout}@{world}: {n}")
        if big is not None and not torch.equal(
            local_of(state["big"]), local_of(make(big, rank, world))
        ):
            wrong.append(f"big -> {dest_layout}@{world}")
    ckpt = unickpt.Checkpointer(f"{root}/run")
    dest = {"w": zeroed(LAYOUTS["flat"](tensors["a"], rank, world))}
    if ckpt.load_latest(dest) != 2 or ckpt.steps() != [2]:
        wrong.append(f"steps {ckpt.steps()}")
    if not torch.equal(
        local_of(dest["w"]), local_of(LAYOUTS["flat"](tensors["a"] * 2, rank, world))
    ):
        wrong.append("checkpointer step 2")
    return wrong, read, wanted
