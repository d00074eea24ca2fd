"""A safetensors overwrite killed at any instant leaves the old model or the new one, read by
the safetensors library as ``from_pretrained`` reads a folder and by ``unickpt.load``: never a
mix of the two (nor, here, a folder that refuses to load)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import unickpt

from ..distributed import start_process
from .jobs import (
    overwrite_forever,
    overwrite_killed,
    overwrite_model,
    save_model,
)

SCENARIOS = [
    ("three shards", "three shards"),  # every new name is taken by an old shard
    ("three shards", "two shards"),
    ("one file", "three shards"),
    ("three shards", "one file"),
    ("one file", "one file"),
]


def read_with_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's model as ``from_pretrained`` finds it: ``model.safetensors``, else the
    shards its index names."""
    if (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(folder / name, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def read_with_unickpt(folder: Path) -> dict[str, torch.Tensor]:
    state = {k: torch.zeros_like(v) for k, v in overwrite_model(0).items()}
    unickpt.load(folder, state)
    return state


def which(found: dict[str, torch.Tensor], seeds: tuple[int, ...]) -> str:
    for seed in seeds:
        model = overwrite_model(seed)
        if found.keys() == model.keys() and all(torch.equal(found[k], v) for k, v in model.items()):
            return f"model {seed}"
    return "a mix: " + ", ".join(f"{k}={float(v[0, 0]):.1f}" for k, v in sorted(found.items()))


def outcomes(folder: Path, seeds: tuple[int, ...]) -> tuple[str, str]:
    """What each reader finds in ``folder``: one of the models, a mix, or a refusal."""
    found = []
    for read in (read_with_safetensors, read_with_unickpt):
        try:
            found.append(which(read(folder), seeds))
        except Exception as e:  # noqa: BLE001 - a refusal is an outcome
            found.append(f"refused ({type(e).__name__}: {e})")
    return found[0], found[1]


def standard_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _run(target: object, *args: object) -> int | None:
    proc = start_process(target, *args)  # type: ignore[arg-type]
    proc.join(120)
    return proc.exitcode


@pytest.mark.parametrize(("old", "new"), SCENARIOS)
def test_an_overwrite_killed_at_every_step_leaves_the_old_or_the_new_model(
    tmp_path: Path, old: str, new: str
) -> None:
    """The overwrite is killed (SIGKILL) before each of its renames, links and removals in
    turn: both readers find the old model until the switch, the new one after it; the next
    overwrite then leaves Hugging Face's file names alone."""
    base = tmp_path / "base"
    save_model(str(base), 1, old)
    steps_file = tmp_path / "steps"
    done = tmp_path / "done"
    shutil.copytree(base, done)
    assert _run(overwrite_killed, str(done), 2, new, 0, str(steps_file)) == 0
    steps = int(steps_file.read_text())
    assert steps >= 2
    assert outcomes(done, (2,)) == ("model 2", "model 2")
    final = standard_names(done)
    seen = []
    for kill_at in range(1, steps + 1):
        folder = tmp_path / f"killed-{kill_at}"
        shutil.copytree(base, folder)
        assert _run(overwrite_killed, str(folder), 2, new, kill_at, str(steps_file)) == (
            -signal.SIGKILL
        )
        found = outcomes(folder, (1, 2))
        assert found[0] == found[1] and found[0] in ("model 1", "model 2"), (kill_at, found)
        seen.append(found[0])
        save_model(str(folder), 2, new)  # the next overwrite clears what the crash left
        assert standard_names(folder) == final, kill_at
    assert seen[0] == "model 1"
    assert seen == sorted(seen), seen  # old until the switch, new from it on
    if new == "one file":
        assert final == ["model.safetensors"]
    else:
        n = len(final) - 1
        shards = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        assert final == [*shards, "model.safetensors.index.json"]


def test_overwrites_killed_at_random_instants_leave_one_model(tmp_path: Path) -> None:
    """A process overwrites a folder again and again (two models, three layouts in turn) and is
    killed at a random instant, 25 times: each reader finds one whole model."""
    folder = tmp_path / "model"
    save_model(str(folder), 1, "one file")
    rng = random.Random(37)
    for trial in range(25):
        ready = tmp_path / f"ready-{trial}"
        proc = start_process(overwrite_forever, str(folder), str(ready))
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL, trial
        found = outcomes(folder, (1, 2))
        assert found[0] == found[1] and found[0] in ("model 1", "model 2"), (trial, found)


def test_the_overwritten_folder_loads_with_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=64)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(transformers.GPT2LMHeadModel(config).eval())
    out = tmp_path / "hf"
    for model in models:  # the second overwrites the first, shard names alike
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        unickpt.save(out, state, format="safetensors", max_shard_size="30KB", overwrite=True)
    config.save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, models[1](ids).logits)
    names = [p.name for p in out.iterdir() if p.suffix == ".safetensors"]
    assert names and all(n.startswith("model-") and n.count("-") == 3 for n in names)
