""":class:`Children`: the supervised children of a
:class:`~kvlens.stack.launch.Stack` (:class:`~kvlens.stack.supervise.Child`),
oldest first: each started and recorded at once (the stack writes
``stack.json``, which :mod:`kvlens.stack.leftovers` reads), the first that
died, their pids, and their stop, newest first. A link delayer's death is not
the stack's: it is handed to the stack's network
(:meth:`~kvlens.stack.netstack.StackNetwork.delayer_died`). Blocking.
"""

from __future__ import annotations

from typing import Callable

from kvlens.stack.supervise import Child, stop_children

#: The name of a link delayer's child opens with it (``delay-p0-d0``: :mod:`kvlens.stack.netstack`).
DELAYER_PREFIX = "delay-"


class Children:
    """A stack's children. ``record``: called after each start (the stack's
    ``stack.json``); ``delayer_died``: called with a link delayer that exited,
    each time :meth:`dead` passes over it."""

    def __init__(self, record: Callable[[], None], delayer_died: Callable[[Child], None]) -> None:
        self.started: list[Child] = []  #: every child started, oldest first (the stack's ``children``)
        self.record = record
        self.delayer_died = delayer_died

    def spawn(self, c: Child) -> Child:
        """Start ``c``, keep it, and record it at once."""
        c.start()
        self.started.append(c)
        self.record()
        return c

    def dead(self, delayers: bool = False) -> Child | None:
        """The first child that exited. A link delayer's death is not the
        stack's (``delayers`` False): it goes to ``delayer_died`` and is passed over."""
        for c in self.started:
            if c.proc is not None and c.proc.poll() is not None:
                if c.name.startswith(DELAYER_PREFIX) and not delayers:
                    self.delayer_died(c)
                    continue
                return c
        return None

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.started if c.proc is not None]

    def pid_of(self, name: str) -> int | None:
        """The pid of the child called ``name``, None when it was not started."""
        return next((c.proc.pid for c in self.started if c.name == name and c.proc is not None), None)

    def stop(self) -> None:
        """Stop every child, newest first, and forget them."""
        stop_children(list(reversed(self.started)))
        self.started = []
