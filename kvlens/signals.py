"""Signal handling shared by the long-running commands (``up``, ``bench``,
``demo``): SIGTERM and SIGHUP unwind like Ctrl-C, so the same ``finally``
blocks stop every child process and keep finished results."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM or SIGHUP (a KeyboardInterrupt,
    so code that already handles Ctrl-C handles it the same way).
    ``signum``: the signal."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP (a closed terminal, a lost SSH
    session) raise :class:`Terminated`; SIGINT raises KeyboardInterrupt even
    when the process was started with SIGINT ignored (background shells,
    CI steps). A SIGHUP ignored at start (``nohup``) stays ignored: that is
    what the user asked for. Main thread only."""
    old = {signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_terminated)}
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        old[signal.SIGHUP] = signal.signal(signal.SIGHUP, _raise_terminated)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
