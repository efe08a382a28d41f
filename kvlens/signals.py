"""Signal handling shared by the long-running commands (``up``, ``bench``,
``demo``): SIGTERM unwinds like Ctrl-C, so the same ``finally`` blocks stop
every child process and keep finished results."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM (a KeyboardInterrupt, so code that
    already handles Ctrl-C handles it the same way)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated`; SIGINT raises
    KeyboardInterrupt even when the process was started with SIGINT ignored
    (background shells, nohup, CI steps). Main thread only."""
    old_term = signal.signal(signal.SIGTERM, _raise_terminated)
    old_int = signal.getsignal(signal.SIGINT)
    if old_int is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if old_int is signal.SIG_IGN:
            signal.signal(signal.SIGINT, old_int)
