"""``unickpt``: the command line entry point. Each command lives in its own module.

Only the module of the command being run is imported (torch and the library with it), so
``unickpt --version`` and ``unickpt --help`` answer at once; the others appear in the help
with the one-line summary of :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from .._version import __version__
from .commands import COMMANDS


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the command ``argv`` names is imported and registered
    in full (the others as summaries), without it every command."""
    wanted = _command_named(argv) if argv is not None else None
    parser = argparse.ArgumentParser(
        prog="unickpt",
        description="Checkpoints for PyTorch training: save in any layout, load in any other.",
    )
    parser.add_argument("--version", action="version", version=f"unickpt {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in COMMANDS.items():
        if argv is not None and name != wanted:
            sub.add_parser(name, help=summary, add_help=False)
            continue
        try:
            module = importlib.import_module(f"unickpt.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"unickpt.cli.{name}":
                raise
            continue
        module.register(sub)
    return parser


def _command_named(argv: list[str]) -> str | None:
    """The command in ``argv``: its first word that is not an option (the top-level options
    take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed; an argument no parser knows is reported with the usage of the command
    it was given to (``unickpt inspect --stepp 3`` shows inspect's usage)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = _subparser(parser, getattr(args, "command", None)) or parser
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            chosen: argparse.ArgumentParser = action.choices[name]
            return chosen
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:
        # The reader went away (`unickpt inspect ... | head`): stop quietly, as Unix tools do.
        # Python would flush stdout again at exit and fail once more, so point it at devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, the status a shell reports for a process the pipe stopped


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parse(parser, argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    code = int(args.func(args) or 0)
    sys.stdout.flush()  # a closed pipe shows here, inside main, not at interpreter exit
    return code


if __name__ == "__main__":
    sys.exit(main())
