"""Exports hold one block (safetensors, torch) or about two tensors (DCP's writer) at a time, so
peak memory stays far below the size of the checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import unickpt

MiB = 1 << 20
TENSORS = 10
TENSOR_BYTES = 8 * MiB

_SCRIPT = """
import sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from unickpt.tools import export_dcp, export_safetensors, export_torch

def status_kb(field):
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith(field)).split()[1])

src, out = sys.argv[1], sys.argv[2]
with FakeTensorMode():  # its one-time setup is not what this measures
    torch.empty(3)
base_kb = status_kb("VmRSS:")
export_safetensors(src, out + "/st", block_bytes=1 << 20)
export_torch(src, out + "/c.pt", block_bytes=1 << 20)
export_dcp(src, out + "/dcp")
print(base_kb, status_kb("VmHWM:"))
"""


def test_exports_stream(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    n = TENSOR_BYTES // 4
    unickpt.save(tmp_path / "c", {f"w{i}": torch.randn(n, generator=g) for i in range(TENSORS)})
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "c"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MiB)},  # freed blocks leave at once
    )
    assert done.returncode == 0, done.stderr
    base_kb, peak_kb = (int(x) for x in done.stdout.split())
    grown = (peak_kb - base_kb) * 1024
    assert grown < 3 * TENSOR_BYTES, (
        f"grew {grown / MiB:.0f} MiB for {TENSORS} x {TENSOR_BYTES // MiB} MiB"
    )
