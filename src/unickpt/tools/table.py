"""Plain-text tables, as the command line prints them."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: str = "") -> str:
    """Columns padded to their widest cell; columns whose index is in ``right`` (as digits,
    e.g. ``"45"``) are right-aligned.

    >>> print(format_table(["key", "n"], [["a", "1"], ["bb", "10"]], right="1"))
    key   n
    a     1
    bb   10
    """
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    lines = []
    for row in [headers, *rows]:
        cells = [
            str(c).rjust(w) if str(i) in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
