"""examples/train.py as a user runs it: torchrun, 2 processes on CPU. An FSDP2 run saves to
step 8; its steps after 4 are removed (a crash after the save of step 4); FSDP2 resumes with
the losses of the uninterrupted run, bit for bit, and DDP resumes the same checkpoint side by
side (FSDP2's shards loaded into DDP's whole tensors) within rounding of them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _start(parallel: str, out: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    argv += [str(ROOT / "examples" / "train.py"), "--parallel", parallel, "--steps", "8"]
    argv += ["--save-every", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _losses(proc: subprocess.Popen[str]) -> tuple[str, dict[int, float]]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    found = {int(s): float(x) for s, x in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)}
    return out.splitlines()[0], found


def _crash_after_step_4(root: Path) -> None:
    for folder in root.glob("step-*"):
        if int(folder.name.removeprefix("step-")) > 4:
            shutil.rmtree(folder)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_example_resumes_under_fsdp2_and_ddp(tmp_path: Path) -> None:
    first, reference = _losses(_start("fsdp2", tmp_path / "run"))
    assert first == "started fresh" and sorted(reference) == list(range(1, 9))
    _crash_after_step_4(tmp_path / "run")
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    fsdp2, ddp = _start("fsdp2", tmp_path / "run"), _start("ddp", tmp_path / "copy")
    for proc, exact in ((fsdp2, True), (ddp, False)):
        first, resumed = _losses(proc)
        assert first == "resumed from step 4" and sorted(resumed) == [5, 6, 7, 8]
        for step, loss in resumed.items():
            if exact:
                assert loss == reference[step], (step, loss, reference[step])
            else:
                assert loss == pytest.approx(reference[step], rel=1e-5), step
