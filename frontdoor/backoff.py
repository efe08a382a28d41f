"""Refused credentials slow their client down (issue 42, item 10): a client
(its address, :func:`frontdoor.bearer.client_of`) that keeps sending wrong
tokens must wait, and while it waits its tokens are not compared at all (no
oracle for a guesser who ignores ``Retry-After``).

Two policies, one interface (:class:`Backoff`: ``wait``, ``failed``, ``succeeded``, what
:class:`frontdoor.bearer.BearerAuth` calls):

* :class:`FailureBackoff`, the API's (router, collector): after
  :data:`BACKOFF_FAILURES` refusals in :data:`BACKOFF_WINDOW_S` seconds (a
  window starts at a client's first refusal), every guarded request from it
  gets 429 until the window ends; a success does not shorten it. Clients
  are programs that retry on their own.
* :class:`SignInBackoff`, the dashboard sign-in's: a person mistypes, so
  :data:`SIGNIN_FREE` wrong tokens are free; each further one makes the
  address wait :data:`SIGNIN_FIRST_S` seconds, doubling, at most
  :data:`SIGNIN_MAX_S`; the right token forgets the count.

Memory is bounded either way (:data:`BACKOFF_CLIENTS` addresses, the least
recently failing one dropped first), so a flood of addresses cannot grow
it. The key is the address the server sees: behind a reverse proxy every
user shares the proxy's.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Protocol

#: Refusals of one client within :data:`BACKOFF_WINDOW_S` before it gets 429 (:class:`FailureBackoff`).
BACKOFF_FAILURES = 20
BACKOFF_WINDOW_S = 60.0
#: Clients remembered at most (the least recently failed one is forgotten first).
BACKOFF_CLIENTS = 4096
#: Wrong tokens one address may send the dashboard before it must wait (:class:`SignInBackoff`).
SIGNIN_FREE = 5
#: The first wait after :data:`SIGNIN_FREE` failures; it doubles per further failure, up to :data:`SIGNIN_MAX_S`.
SIGNIN_FIRST_S = 2.0
SIGNIN_MAX_S = 300.0
#: An address's failures are forgotten after this long without one (longer than the longest wait).
SIGNIN_FORGET_S = 600.0


class Backoff(Protocol):
    """What :class:`frontdoor.bearer.BearerAuth` asks of a policy."""

    def wait(self, client: str) -> float:
        """Seconds ``client`` must still wait before a token of it is compared (0: none)."""

    def failed(self, client: str) -> None:
        """One refused token from ``client``."""

    def succeeded(self, client: str) -> None:
        """``client`` gave a right token."""


class FailureBackoff:
    """Per-client count of refused credentials (module docstring): after
    ``failures`` refusals within ``window_s`` seconds, :meth:`wait` says how
    long the client must still wait. At most ``max_clients`` are remembered.
    Any thread."""

    def __init__(
        self,
        failures: int = BACKOFF_FAILURES,
        window_s: float = BACKOFF_WINDOW_S,
        max_clients: int = BACKOFF_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures, self.window_s, self.max_clients, self.clock = failures, window_s, max_clients, clock
        self._seen: OrderedDict[str, list] = OrderedDict()  # client -> [window start, refusals]
        self._lock = threading.Lock()

    def wait(self, client: str) -> float:
        """Seconds ``client`` must still wait (0: not blocked)."""
        with self._lock:
            e = self._seen.get(client)
            if e is None or e[1] < self.failures:
                return 0.0
            return max(0.0, e[0] + self.window_s - self.clock())

    def failed(self, client: str) -> None:
        """Count one refusal of ``client``."""
        now = self.clock()
        with self._lock:
            e = self._seen.get(client)
            if e is None or now - e[0] >= self.window_s:
                e = self._seen[client] = [now, 0]
            e[1] += 1
            self._seen.move_to_end(client)
            while len(self._seen) > self.max_clients:
                self._seen.popitem(last=False)

    def succeeded(self, client: str) -> None:
        """Nothing: a window, once started, runs its course."""

    def __len__(self) -> int:
        return len(self._seen)


class SignInBackoff:
    """Wrong tokens per client address (module docstring): after ``free``
    failures, each further one makes that address wait ``first_s`` seconds,
    doubling, at most ``max_s``; a client without a failure for ``forget_s``
    starts afresh, and a correct token clears it. At most ``max_clients``
    addresses are kept. Event loop only (Streamlit's server has one)."""

    def __init__(
        self,
        free: int = SIGNIN_FREE,
        first_s: float = SIGNIN_FIRST_S,
        max_s: float = SIGNIN_MAX_S,
        forget_s: float = SIGNIN_FORGET_S,
        max_clients: int = BACKOFF_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.free, self.first_s, self.max_s, self.forget_s = free, first_s, max_s, forget_s
        self.max_clients, self.clock = max_clients, clock
        self._seen: OrderedDict[str, list[float]] = OrderedDict()  # client -> [failures, last failure, wait until]

    def wait(self, client: str) -> float:
        """Seconds ``client`` must still wait before a token of it is compared (0: none)."""
        e = self._seen.get(client)
        return 0.0 if e is None else max(0.0, e[2] - self.clock())

    def failed(self, client: str) -> None:
        """One wrong token from ``client``."""
        now = self.clock()
        e = self._seen.get(client)
        if e is None or now - e[1] >= self.forget_s:
            e = self._seen[client] = [0, now, now]
        e[0] += 1
        e[1] = now
        if e[0] >= self.free:
            e[2] = now + min(self.max_s, self.first_s * 2 ** min(e[0] - self.free, 32))
        self._seen.move_to_end(client)
        while len(self._seen) > self.max_clients:
            self._seen.popitem(last=False)

    def succeeded(self, client: str) -> None:
        """``client`` gave the right token: its failures are forgotten."""
        self._seen.pop(client, None)

    def __len__(self) -> int:
        return len(self._seen)
