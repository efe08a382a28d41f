"""Periodic work on a background thread that already exists (the recorder's):
a mixin, so a process gets no second always-on thread for work that must stay
off vLLM's threads (:mod:`exporters.health`)."""

from __future__ import annotations

import time
from typing import Callable

from kvrecord.logutil import log_once


class Periodic:
    """``add_periodic`` registers a call; the owner's background loop calls
    :meth:`_run_periodic` at each wake (it must wake at least once a second)."""

    _periodic: list = []  # [fn, every_s, next due (monotonic)]; replaced per instance by add_periodic

    def add_periodic(self, fn: Callable[[], None], every_s: float = 1.0) -> None:
        """Run ``fn()`` on the background thread about every ``every_s`` (at
        its next wake after that). ``fn`` must not block; an exception is
        logged once and skipped. Starts the thread (``self.start()``)."""
        self._periodic = [*self._periodic, [fn, float(every_s), 0.0]]
        self.start()

    def _run_periodic(self) -> None:
        """Background thread: the periodic calls that are due."""
        if not self._periodic:
            return
        now = time.monotonic()
        for p in self._periodic:
            if now >= p[2]:
                p[2] = now + p[1]
                try:
                    p[0]()
                except Exception:
                    log_once("periodic", "kvlens periodic task failed; skipped", exc_info=True)
