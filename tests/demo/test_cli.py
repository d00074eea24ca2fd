from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path

import pytest

from unickpt.cli import demo
from unickpt.demo import DemoConfig
from unickpt.demo.events import PhaseFinished


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unickpt")
    demo.register(parser.add_subparsers(dest="command"))
    return parser


def test_demo_command_has_help_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["demo"])
    assert args.func is demo.run
    assert (args.out, args.steps, args.save_every, args.kill_at) == ("out/demo", 60, 5, None)
    with pytest.raises(SystemExit):
        _parser().parse_args(["demo", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--out", "--steps", "--save-every", "--kill-at", "--regrow-at", "torchrun"):
        assert flag in help_text


def test_invalid_settings_exit_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parser().parse_args(["demo", "--out", str(tmp_path), "--kill-at", "23"])
    assert args.func(args) == 2
    assert "not a multiple of save_every" in capsys.readouterr().err
    assert not (tmp_path / "checkpoints").exists()


def test_the_entry_point_lists_demo() -> None:
    main = pytest.importorskip("unickpt.cli.main")
    assert "demo" in main.build_parser().format_help()


def test_the_default_folder_is_ignored_by_git() -> None:
    root = Path(__file__).resolve().parents[2]
    ignored = (root / ".gitignore").read_text().splitlines()
    assert DemoConfig().out_dir.split("/")[0] == "out" and "/out/" in ignored


def test_progress_bars_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _parser().parse_args(["demo"])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not demo.wants_bars(args)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert demo.wants_bars(args)
    assert not demo.wants_bars(_parser().parse_args(["demo", "--no-progress"]))


_EMIT_PHASES = """
import sys
from unickpt.cli.demo import with_phase_lines
from unickpt.demo.events import Loaded, PhaseFinished, PhaseStarted, StepDone, WorkerKilled

sink = with_phase_lines(lambda event: None)
sink(PhaseStarted("crash", "2 procs, async saves", 2, 60, 1000, False))
sink(StepDone("crash", 1, 3.5))
sink(WorkerKilled("crash", 1, 4242, 25))
sys.stdin.readline()  # the line above must already be readable: flushed, not at exit
sink(PhaseFinished("crash", 25, 12.25))
sink(PhaseStarted("resume", "1 proc, resharded", 1, 60, 1000, True))
sink(Loaded("resume", 25, 0.5, "abc"))
"""


def test_phase_lines_when_stdout_is_a_pipe() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _EMIT_PHASES],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    early = [proc.stdout.readline(), proc.stdout.readline()]  # while the process waits
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0, err
    assert [*early, *out.splitlines(keepends=True)] == [
        "2 procs, async saves: starting on 2 processes, training to step 60\n",
        "2 procs, async saves: rank 1 killed during the save of step 25\n",
        "2 procs, async saves: finished at step 25 in 12.2 s\n",
        "1 proc, resharded: resuming on 1 process, training to step 60\n",
        "1 proc, resharded: loaded step 25 in 0.50 s\n",
    ]


def test_no_phase_lines_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    out = io.StringIO()
    monkeypatch.setattr(out, "isatty", lambda: True)
    sink = demo.with_phase_lines(seen.append, out)
    event = PhaseFinished("p", 3, 1.0)
    sink(event)
    assert seen == [event] and out.getvalue() == ""
