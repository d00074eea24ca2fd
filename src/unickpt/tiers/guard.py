"""Save on the way down: SIGTERM, SIGINT or an exception ends the guarded block.

``with ckpt.guard():`` around the training loop installs handlers for SIGTERM and SIGINT (in
the main thread; elsewhere only exceptions are caught). On a signal, or an exception escaping
the block (``SystemExit`` and ``KeyboardInterrupt`` included), ``down()`` runs once (it bounds
its own time), and then the process goes on as it would have: the exception is re-raised; a
signal gets its previous handler, or with the default action, is raised again, so the process
ends by that signal. The handlers are put back when the block ends. A survivor of a failure
that recovers in the same process (:class:`~unickpt.errors.MembershipChanged`) is not going
down: nothing runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from ..errors import MembershipChanged

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def guard(down: Callable[[], None]) -> Iterator[None]:
    ran = threading.Event()

    def once() -> None:
        if not ran.is_set():
            ran.set()
            down()

    previous: dict[int, Any] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        once()
        before = previous.pop(signum, signal.SIG_DFL)
        signal.signal(signum, before)
        if before is signal.SIG_IGN:
            return
        if callable(before):
            before(signum, frame)  # SIGINT's default raises KeyboardInterrupt here
            return
        os.kill(os.getpid(), signum)  # the default action: end by this signal

    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    except MembershipChanged:
        raise
    except BaseException:
        once()
        raise
    finally:
        for signum, before in previous.items():
            if signal.getsignal(signum) is handler:
                signal.signal(signum, before)
