"""The command line as a Unix tool: quiet on a closed pipe, the subcommand's usage on a bad
option, no torch import for --version, error messages in terms of its flags. Run as real
subprocesses of ``python -m unickpt.cli.main``; a check of an error message, which no
interpreter's start or exit changes, runs the module in a process forked with torch imported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import unickpt
from tests.cli.forked_cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CLI = [sys.executable, "-m", "unickpt.cli.main"]


def _many_values(path: Path, offset: int = 0) -> None:
    """A checkpoint whose inspect and diff outputs are far larger than a pipe's buffer."""
    unickpt.save(path, {"v": {f"key{i:05d}": f"value number {i + offset}" for i in range(3000)}})


def _start_reader(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _read_one_line_then_close(proc: subprocess.Popen[bytes]) -> subprocess.CompletedProcess[bytes]:
    """Read one line of ``proc``'s stdout, then close the pipe (``| head -1``); how it ended."""
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    code = proc.wait(timeout=120)
    return subprocess.CompletedProcess(proc.args, code, first, err)


def test_a_closed_pipe_ends_the_commands_quietly(tmp_path: Path) -> None:
    """inspect and diff, whose outputs are far larger than a pipe's buffer, run side by side."""
    _many_values(tmp_path / "a")
    _many_values(tmp_path / "b", offset=1)
    commands = {
        "inspect": [str(tmp_path / "a")],
        "diff": [str(tmp_path / "a"), str(tmp_path / "b")],
    }
    started = {name: _start_reader([*CLI, name, *args]) for name, args in commands.items()}
    for name, proc in started.items():
        done = _read_one_line_then_close(proc)
        assert done.stdout, name  # the one line read
        assert b"Traceback" not in done.stderr and b"BrokenPipeError" not in done.stderr, name
        assert done.stderr == b"", (name, done.stderr)
        assert done.returncode in (0, 141), (name, done.returncode)


def test_version_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from unickpt.cli.main import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0\n"
        "heavy = [m for m in ('torch', 'numpy', 'unickpt.checkpointer') if m in sys.modules]\n"
        "print(','.join(heavy) or 'light')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"unickpt {unickpt.__version__}", "light"]


def _imported(importtime: str) -> set[str]:
    """The modules a ``python -X importtime`` run imported, from its stderr."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }


def test_inspect_verify_and_diff_import_no_torch(tmp_path: Path) -> None:
    """The real command line in fresh interpreters, side by side: inspect, verify and diff of
    unickpt checkpoints (per-rank RNG tensors, tied weights, compressed chunks) import no torch
    and give the answers of the library."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 64))
    state = {"model": model, "head": model[0].weight, "rng": unickpt.RNGState(), "step": 3}
    unickpt.save(tmp_path / "a", state)
    with torch.no_grad():
        model[1].weight[5, 7] += 0.5
    unickpt.save(tmp_path / "b", {**state, "step": 4}, compress=True)
    commands = {
        "inspect": ["inspect", str(tmp_path / "a")],
        "verify": ["verify", str(tmp_path / "b")],
        "diff": ["diff", str(tmp_path / "a"), str(tmp_path / "b")],
    }
    started = {
        name: subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "unickpt.cli.main", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in commands.items()
    }
    done = {name: (p.communicate(timeout=300), p.returncode) for name, p in started.items()}
    for name, ((_, err), _) in done.items():
        imported = _imported(err)
        assert "unickpt.cli" in imported and "numpy" in imported, name
        assert not {m for m in imported if m == "torch" or m.startswith("torch.")}, name
    (out, _), code = done["inspect"]
    assert code == 0 and "model.1.weight" in out and "rng.generators" in out, out
    assert "dict (per rank)" in out
    (out, _), code = done["verify"]
    assert code == 0 and out.startswith("OK: "), out
    (out, _), code = done["diff"]
    assert code == 1, out
    assert re.search(r"model\.1\.weight +values differ +0\.5 +\S+ +1\n", out), out
    assert re.search(r"step +differs +3 +4", out), out
    assert "model.0.weight" not in out and "head" not in out, out


def test_help_lists_every_command_as_their_modules_say(capsys: pytest.CaptureFixture[str]) -> None:
    from unickpt.cli.main import build_parser

    assert build_parser([]).format_help() == build_parser().format_help()


def test_a_bad_option_shows_the_commands_usage(tmp_path: Path) -> None:
    done = subprocess.run(
        [*CLI, "inspect", "--stepp", "3"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.startswith("usage: unickpt inspect ")
    assert "unickpt inspect: error: unrecognized arguments: --stepp" in done.stderr
    done = subprocess.run([*CLI, "--nope"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("usage: unickpt [-h]")


def test_a_file_that_is_not_torch_save_is_named_not_pickle(tmp_path: Path) -> None:
    (tmp_path / "hostname").write_text("myhost\n")
    done = run_cli(
        ["convert", str(tmp_path / "hostname"), str(tmp_path / "y"), "--from", "torch"], tmp_path
    )
    assert done.returncode == 2
    assert "is not a torch.save file (it starts with b'myhost\\n')" in done.stderr
    assert "--allow-pickle" not in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "y").exists()
