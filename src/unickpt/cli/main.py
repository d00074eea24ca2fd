"""``unickpt``: the command line entry point. Each command lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .._version import __version__

COMMANDS = ("demo", "inspect", "verify", "diff", "convert", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unickpt",
        description="Checkpoints for PyTorch training: save in any layout, load in any other.",
    )
    parser.add_argument("--version", action="version", version=f"unickpt {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"unickpt.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"unickpt.cli.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
