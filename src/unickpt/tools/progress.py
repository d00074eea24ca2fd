"""Progress reporting: the library calls a plain callback; the command line draws a bar.

Long operations take ``progress: ProgressFn | None`` and call it with
``(bytes_done, bytes_total)`` after each step. :func:`progress_bar` makes such a callback that
draws a tqdm bar on stderr, for the command line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ProgressFn = Callable[[int, int], None]


def wants_progress(forced: bool) -> bool:
    """Bars are drawn when asked for, or when stderr is a terminal."""
    return forced or sys.stderr.isatty()


@contextmanager
def progress_bar(description: str, enabled: bool) -> Iterator[ProgressFn | None]:
    """A callback that advances a byte-scaled tqdm bar on stderr (None when not ``enabled``)."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm  # only where a bar is drawn: a command piped elsewhere never needs it

    bar = tqdm(desc=description, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)

    def update(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        bar.close()
