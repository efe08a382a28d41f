"""Which P and which D serve a request (:class:`Balancer`): round robin over
every (P, D) pair.

Why round robin and nothing smarter: the router's job here is to spread
requests over the instances it was given so that every (P, D) pair shows up
in the traces; a load-aware policy would need the instances' queue depths,
which the router does not have. A failed request does not take its upstream
out of the rotation: the next request simply goes to the next instance
(failures stay per request, :mod:`proxy.retry`), so one broken
instance costs its share of requests, never the others.

Why a cycle over the pairs: two counters stepped together (P = k mod N,
D = k mod M) only ever meet some pairs when N and M share a divisor (2 x 2:
P0-D0 and P1-D1 forever), so a slow pair, or one whose first NIXL handshake
is still to come, would hide. Request k goes to P = k mod N and
D = (k div N + P) mod M: every N*M requests visit every (P, D) pair once,
each P gets M of them and each D gets N (2 x 2: P0-D0, P1-D1, P0-D1, P1-D0).

:meth:`Balancer.pick` holds a lock for one integer increment: safe from the
event loop (it never awaits) and from threads (tests, a future worker pool).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from kvrecord import semconv as sc
from proxy.config import Decode, Prefill, ProxyConfig


@dataclass(frozen=True)
class Route:
    """The P and D one request goes to."""

    prefill: Prefill
    decode: Decode

    def attrs(self) -> dict[str, str]:
        """Root-span attributes naming both instances (the vocabulary's names)."""
        return {
            sc.ATTR_PREFILL_URL: self.prefill.url,
            sc.ATTR_PREFILL_ENGINE_ID: self.prefill.engine_id,
            sc.ATTR_DECODE_URL: self.decode.url,
            sc.ATTR_DECODE_ENGINE_ID: self.decode.engine_id,
        }


class Balancer:
    """Round robin over a config's P instances and, independently, its D
    instances (module docstring)."""

    def __init__(self, prefills: Sequence[Prefill], decodes: Sequence[Decode]) -> None:
        if not prefills or not decodes:
            raise ValueError("round robin over nothing")
        self.prefills: tuple[Prefill, ...] = tuple(prefills)
        self.decodes: tuple[Decode, ...] = tuple(decodes)
        self._k = 0
        self._lock = threading.Lock()

    @classmethod
    def for_config(cls, cfg: ProxyConfig) -> "Balancer":
        return cls(cfg.prefills, cfg.decodes)

    def pick(self) -> Route:
        """The next (P, D) pair of the cycle (module docstring)."""
        n, m = len(self.prefills), len(self.decodes)
        with self._lock:
            k = self._k
            self._k = (k + 1) % (n * m)
        p = k % n
        return Route(self.prefills[p], self.decodes[(k // n + p) % m])

    @property
    def pairs(self) -> int:
        """Requests in one cycle over every (P, D) pair."""
        return len(self.prefills) * len(self.decodes)
