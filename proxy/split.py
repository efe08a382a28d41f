"""A mixed fleet's split (:class:`Split`): which mode, push or pull, each
request goes to, drawn at random with the push weight ``w``, and the count
of what each mode's requests came to.

Why a random draw and not a cycle: a canary compares the two modes on the
same traffic at the same time; a draw per request (Bernoulli with ``w``)
gives each mode a random sample of the requests, whatever their order or
length, so a periodic pattern in the traffic cannot line up with the modes.
The weight changes live (``POST /admin/split``, :meth:`Split.set`): the
engines keep running; the requests in flight keep the mode they drew.

Thread-safe (one lock around the RNG and the counters: a few operations,
never an await).
"""

from __future__ import annotations

import random
import threading

from proxy.config import MODES

#: What a request of one mode came to, as counted: ``ok`` or ``failed``
#: (every other outcome: timeout, client gone, refused upstream).
OUTCOMES = ("ok", "failed")


def parse_split(text: str) -> float:
    """``push=0.25`` / ``pull=0.75`` / ``0.25`` (a bare number: the push
    weight) as the push weight; ValueError naming the problem."""
    raw = str(text).strip()
    mode, sep, value = raw.partition("=")
    if not sep:
        mode, value = "push", raw
    mode = mode.strip().lower()
    if mode not in MODES:
        raise ValueError(f"split must be push=W or pull=W with W in [0, 1], got {text!r}")
    try:
        w = float(value)
    except ValueError:
        raise ValueError(f"split must be push=W or pull=W with W in [0, 1], got {text!r}") from None
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"split weight must lie in [0, 1], got {text!r}")
    return w if mode == "push" else push_of_pull(w)


def push_of_pull(w: float) -> float:
    """The push weight of pull weight ``w`` (rounded: ``pull=0.7`` is push 0.3, not 0.30000000000000004)."""
    return round(1.0 - float(w), 12)


class Split:
    """The push weight and the RNG that draws each request's mode;
    ``seed``: a reproducible sequence of draws (tests)."""

    def __init__(self, push_weight: float, seed: int | None = None) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._w = self._checked(push_weight)
        self._counts = {m: dict.fromkeys(OUTCOMES, 0) for m in MODES}
        self._drawn = dict.fromkeys(MODES, 0)

    @staticmethod
    def _checked(w: float) -> float:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= float(w) <= 1.0:
            raise ValueError(f"split must be a push weight in [0, 1], got {w!r}")
        return float(w)

    @property
    def push_weight(self) -> float:
        return self._w

    def set(self, push_weight: float) -> float:
        """Change the weight for the requests that come next; returns the old one."""
        w = self._checked(push_weight)
        with self._lock:
            old, self._w = self._w, w
        return old

    def draw(self) -> tuple[str, float]:
        """(the mode of the next request, the weight it was drawn with)."""
        with self._lock:
            w = self._w
            mode = "push" if self._rng.random() < w else "pull"
            self._drawn[mode] += 1
        return mode, w

    def count(self, mode: str, outcome: str) -> None:
        """One request of ``mode`` ended with ``outcome``."""
        with self._lock:
            c = self._counts.get(mode)
            if c is not None:
                c["ok" if outcome == "ok" else "failed"] += 1

    def to_json(self) -> dict:
        """What ``GET /admin/split`` shows: the weights, the draws and the
        requests per mode and outcome since the router started."""
        with self._lock:
            return {
                "split": {"push": self._w, "pull": push_of_pull(self._w)},
                "drawn": dict(self._drawn),
                "requests": {m: dict(c) for m, c in self._counts.items()},
            }
