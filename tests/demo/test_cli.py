from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from unickpt.cli import demo
from unickpt.demo import DemoConfig


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
