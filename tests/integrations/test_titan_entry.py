"""UnickptCheckpointManager under torchtitan's own entry point, as users run it.

``python -m torch.distributed.run --nproc-per-node 2 -m torchtitan.train --module ...`` on 2
CPU processes (gloo) with the llama3 debug model, the manager selected in a config registry
(``titan_entry_config.py``). The run saves step 3 and is killed with SIGKILL before step 6; the
same command run again resumes from the unickpt checkpoint, and the losses of steps 4 and 5
equal those of the killed run, which trained through them uninterrupted.

torchtitan 0.3.0 on torch 2.13.0 and CPU needs the shims of ``titan_cpu/sitecustomize.py``
(device type, ``torch.distributed.set_timeout``, plain-sum gradient reduction); they apply to
the launched processes only. torchtitan's wheel ships neither the ``c4_test`` data set nor the
tokenizer its debug config names (both are in its source tree's ``tests/assets``): the test
writes a small text data set and a word-level tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="needs torchtitan: pip install 'unickpt[torchtitan]'")
pytest.importorskip("triton", reason="torchtitan's models import triton: pip install triton")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SHIMS = Path(__file__).resolve().parent / "titan_cpu"
WORDS = [f"w{i}" for i in range(1000)]
BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
STEPS, INTERVAL, KILLED_AT = 6, 3, 6
RUN_LIMIT_S = 480.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LOSS = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")
HELD = re.compile(r"held before step (\d+) \(pid (\d+)\)")


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of ``WORDS`` (``tokenizer.json``) with Llama's BOS and EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate([UNK, BOS, EOS, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([BOS, EOS])
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_dataset(folder: Path, documents: int = 200) -> None:
    """``c4_test``'s layout: a folder of JSON lines with a ``text`` field; seeded words."""
    rng = random.Random(0)
    folder.mkdir(parents=True)
    with open(folder / "c4_sample.json", "w") as f:
        for _ in range(documents):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
            f.write(json.dumps({"text": text}) + "\n")


def command(assets: Path, dump: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "torchtitan.train",
        "--module",
        "tests.integrations.titan_entry_config",
        "--config",
        "llama3_debugmodel_unickpt",
        "--dump_folder",
        str(dump),
        "--hf_assets_path",
        str(assets / "tokenizer"),
        "--dataloader.dataset_path",
        str(assets / "c4_test"),
        "--training.steps",
        str(STEPS),
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--parallelism.spmd_backend",
        "partial_dtensor",
        "--checkpoint.interval",
        str(INTERVAL),
        "--checkpoint.async_mode",
        "async_with_pinned_mem",
        "--metrics.disable_color_printing",
    ]


def environment(tmp: Path, hold_at: int | None) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(SHIMS), str(REPO), env.get("PYTHONPATH", "")]
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        UNICKPT_TITAN_CPU="1",
        HF_DATASETS_CACHE=str(tmp / "hf-cache"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        # one compute thread per rank (torchrun's own default, unless the caller set another):
        # the losses of two runs are compared as logged, bit for bit
        OMP_NUM_THREADS="1",
    )
    env.pop("UNICKPT_TITAN_HOLD_AT_STEP", None)
    if hold_at is not None:
        env["UNICKPT_TITAN_HOLD_AT_STEP"] = str(hold_at)
    return env


def start(tmp: Path, log: Path, hold_at: int | None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            command(tmp / "assets", tmp / "dump"),
            cwd=tmp,
            env=environment(tmp, hold_at),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def text(log: Path) -> str:
    return ANSI.sub("", log.read_text(errors="replace"))


def held_pids(log: Path) -> list[int]:
    return [int(pid) for _, pid in HELD.findall(text(log))]


def run_until_held(tmp: Path, log: Path) -> subprocess.Popen[bytes]:
    """Start the run; return once both ranks wait before ``KILLED_AT`` with the last save
    committed (two ``Finished saving`` lines per save: one per rank)."""
    proc = start(tmp, log, KILLED_AT)
    deadline = time.monotonic() + RUN_LIMIT_S
    saves = (KILLED_AT - 1) // INTERVAL
    while time.monotonic() < deadline:
        found = text(log)
        if len(held_pids(log)) == 2 and found.count("Finished saving the checkpoint") == 2 * saves:
            return proc
        if proc.poll() is not None:
            pytest.fail(
                f"the run ended (exit {proc.returncode}) before step {KILLED_AT}:\n{tail(log)}"
            )
        time.sleep(0.5)
    stop(proc)
    pytest.fail(f"the run did not reach step {KILLED_AT} in {RUN_LIMIT_S} s:\n{tail(log)}")


def kill(proc: subprocess.Popen[bytes], ranks: list[int]) -> None:
    """SIGKILL to the launcher and to each rank (torchrun starts them in sessions of their own)."""
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def stop(proc: subprocess.Popen[bytes]) -> None:
    """A run that went wrong: SIGTERM to the launcher, which stops its ranks, then SIGKILL."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_to_end(tmp: Path, log: Path) -> None:
    proc = start(tmp, log, None)
    try:
        proc.wait(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"the resumed run did not end in {RUN_LIMIT_S} s:\n{tail(log)}")
    assert proc.returncode == 0, f"the resumed run failed (exit {proc.returncode}):\n{tail(log)}"


def tail(log: Path, lines: int = 60) -> str:
    return "\n".join(text(log).splitlines()[-lines:])


def losses(log: Path) -> dict[int, str]:
    """Each step's loss as the trainer logs it; both ranks log the same global loss."""
    seen: dict[int, set[str]] = {}
    for step, loss in LOSS.findall(text(log)):
        seen.setdefault(int(step), set()).add(loss)
    assert all(len(v) == 1 for v in seen.values()), f"ranks logged different losses: {seen}"
    return {step: v.pop() for step, v in sorted(seen.items())}


def test_killed_run_resumes_from_unickpt_checkpoint(tmp_path: Path) -> None:
    write_tokenizer(tmp_path / "assets" / "tokenizer")
    write_dataset(tmp_path / "assets" / "c4_test")
    ckpt = tmp_path / "dump" / "checkpoint"

    killed_log = tmp_path / "killed.log"
    proc = run_until_held(tmp_path, killed_log)
    kill(proc, held_pids(killed_log))
    killed = losses(killed_log)
    assert sorted(killed) == [1, 2, 3, 4, 5]
    assert f"Saving the checkpoint (step 3) to {ckpt}/step-000000003" in text(killed_log)

    resumed_log = tmp_path / "resumed.log"
    run_to_end(tmp_path, resumed_log)
    resumed = text(resumed_log)
    assert f"Loading the checkpoint from {ckpt}/step-000000003" in resumed
    assert re.search(
        r"Finished loading the checkpoint in [0-9.]+ seconds \(step 3, source storage\)", resumed
    )
    assert "Training starts at step 4" in resumed
    after = losses(resumed_log)
    assert sorted(after) == [4, 5, 6]
    assert {s: after[s] for s in (4, 5)} == {s: killed[s] for s in (4, 5)}
    assert f"Saving the checkpoint (step 6) to {ckpt}/step-000000006" in resumed
