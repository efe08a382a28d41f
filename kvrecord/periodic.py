"""Periodic work on a background thread that already exists (the recorder's),
so a process gets no second always-on thread for work that must stay off
vLLM's threads (:mod:`exporters.handoffhealth`).

A :class:`Periodic` is a schedule its owner holds, not a base class: the
owner adds calls to it (:meth:`Periodic.add`) and its background loop runs
the due ones at each wake (:meth:`Periodic.run_due`)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from kvrecord.logutil import log_once


class Periodic:
    """Calls due every so often, run by their owner's background loop, which
    must wake at least once a second. Adding may happen on any thread."""

    def __init__(self) -> None:
        self._tasks: list[list] = []  # [fn, every_s, next due (monotonic)]
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, fn: Callable[[], None], every_s: float = 1.0) -> None:
        """Run ``fn()`` about every ``every_s`` (at the loop's next wake after
        that; first at its next wake). ``fn`` must not block; an exception is
        logged once and skipped."""
        with self._lock:
            self._tasks = [*self._tasks, [fn, float(every_s), 0.0]]  # a new list: run_due iterates the old one

    def run_due(self) -> None:
        """The owner's background thread: the calls that are due."""
        tasks = self._tasks
        if not tasks:
            return
        now = time.monotonic()
        for task in tasks:
            if now >= task[2]:
                task[2] = now + task[1]
                try:
                    task[0]()
                except Exception:
                    log_once("periodic", "kvlens periodic task failed; skipped", exc_info=True)
