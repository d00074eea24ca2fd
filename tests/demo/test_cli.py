from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from unickpt.cli import demo


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unickpt")
    demo.register(parser.add_subparsers(dest="command"))
    return parser


def test_demo_command_has_help_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["demo"])
    assert args.func is demo.run
    assert (args.out, args.steps, args.save_every, args.kill_at) == ("unickpt-demo", 60, 5, None)
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
