"""``python -m unickpt.cli.main ARGS`` in a process forked from the ranks' fork server, where
torch and unickpt are already imported (a new interpreter spends seconds importing them).

The module runs as ``-m`` runs it (``runpy``, as ``__main__``, with ``sys.argv`` set), its
standard output and error go to files, and its exit status is the process's.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

from tests.distributed import start_process

MODULE = "unickpt.cli.main"


def _run_module(argv: list[str], out: str, err: str) -> None:
    for path, fd in ((out, 1), (err, 2)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [MODULE, *argv]
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)


def run_cli(
    argv: list[str], folder: Path, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run the command line with ``argv`` in a forked process; its exit status and outputs
    (kept in ``folder``)."""
    out, err = folder / "cli-stdout.txt", folder / "cli-stderr.txt"
    proc = start_process(_run_module, argv, str(out), str(err))
    proc.join(timeout=timeout_s)
    if proc.is_alive():
        proc.kill()
        raise AssertionError(f"unickpt {' '.join(argv)} did not end within {timeout_s} s")
    code = proc.exitcode
    assert code is not None
    return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())
