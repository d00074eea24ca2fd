"""How the commands print a library error: in the command line's terms, not Python's."""

from __future__ import annotations

import re
import sys

# The library names its Python arguments; a user of the command line passes flags.
_FLAGS = (
    (re.compile(r"\bpass verify=False to load it anyway\b"), "pass --no-verify to read it anyway"),
    (re.compile(r"\bverify=False\b"), "--no-verify"),
)


def cli_message(message: str) -> str:
    """``message`` with the library's Python arguments replaced by the command's flags."""
    for pattern, flag in _FLAGS:
        message = pattern.sub(flag, message)
    return message


def print_error(error: Exception) -> int:
    """Print ``error`` on stderr as ``error: ...``; the exit status of a failed command (2)."""
    print(f"error: {cli_message(str(error))}", file=sys.stderr)
    return 2
