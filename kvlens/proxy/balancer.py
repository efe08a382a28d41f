"""Which P and which D serve a request (:class:`Balancer`): round robin over
each list, P and D chosen independently.

Why round robin and nothing smarter: the router's job here is to spread
requests over the instances it was given so that every (P, D) pair shows up
in the traces; a load-aware policy would need the instances' queue depths,
which the router does not have. A failed request does not take its upstream
out of the rotation: the next request simply goes to the next instance
(failures stay per request, :mod:`kvlens.proxy.retry`), so one broken
instance costs its share of requests, never the others.

Why independent counters: with one counter for the pair, N P and M D with a
common divisor would only ever see some pairs (2 x 2: P0-D0 and P1-D1).
Independent counters still give every P and every D its share; which pairs
meet depends on N and M, as with any independent round robin.

:meth:`Balancer.pick` holds a lock for two integer increments: safe from the
event loop (it never awaits) and from threads (tests, a future worker pool).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

from instrumented_connector import semconv as sc
from kvlens.proxy.config import Decode, Prefill, ProxyConfig

T = TypeVar("T")


class RoundRobin(Generic[T]):
    """The items in turn, forever; thread-safe."""

    def __init__(self, items: Sequence[T]) -> None:
        if not items:
            raise ValueError("round robin over nothing")
        self.items: tuple[T, ...] = tuple(items)
        self._next = 0
        self._lock = threading.Lock()

    def pick(self) -> T:
        with self._lock:
            i = self._next
            self._next = (i + 1) % len(self.items)
        return self.items[i]


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
        self.prefills = RoundRobin(prefills)
        self.decodes = RoundRobin(decodes)

    @classmethod
    def for_config(cls, cfg: ProxyConfig) -> "Balancer":
        return cls(cfg.prefills, cfg.decodes)

    def pick(self) -> Route:
        """The next P and the next D."""
        return Route(self.prefills.pick(), self.decodes.pick())
