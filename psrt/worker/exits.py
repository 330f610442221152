"""The end of a worker's process: clients still open when the interpreter exits are closed, promptly.

A training script that raises must end its process, and the job, with its code. Without help it would not: at
interpreter exit Python freezes daemon threads before it finalizes objects, so a client closed from its
``__del__`` then would wait forever for its heartbeat thread to let go of its socket. So the first client a
process makes registers one :mod:`atexit` hook (never at import), which runs while threads still run and closes
every client still open: it tells the scheduler ``failed`` (with the exception, in one line) when the program
ended with an uncaught exception, else ``done``, and gives each wait a short deadline.
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from typing import Any, Optional

__all__ = ["track", "failure_of", "current_failure"]

_open: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def track(client: Any) -> None:
    """Close ``client`` at interpreter exit if it is still open then (it must have ``close(failure=...)``)."""
    global _registered
    with _lock:
        _open.add(client)
        if not _registered:
            atexit.register(_close_all)
            _registered = True


def failure_of(exc: Optional[BaseException]) -> Optional[str]:
    """One line saying what ``exc`` is, for the scheduler to name; None for no failure (no exception, or a clean
    ``SystemExit``)."""
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0)):
        return None
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def current_failure() -> Optional[str]:
    """What the program died of, as the interpreter exits (the uncaught exception it printed), or None."""
    return failure_of(getattr(sys, "last_exc", None) or getattr(sys, "last_value", None))


def _close_all() -> None:
    failure = current_failure()
    for client in list(_open):
        try:
            client.close(failure=failure)
        except Exception:  # the process is ending; nothing is left to tell
            pass
