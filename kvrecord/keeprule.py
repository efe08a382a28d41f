"""Which requests keep their spans: the keep rule of the two storage tiers
(docs/fleet.md, "Two tiers").

Every request gets a summary row in the store (its handoff with its bound,
TTFT, outcome, one duration per phase). Its spans are stored too when

* ``--keep all`` (the default: today's behaviour, what a single host wants), or
* ``--keep sampled`` and the request is kept, for the first reason that holds:
  ``failed`` / ``timeout`` / ``expired`` / ``stale`` (its outcome; stale: its
  KV moved after P released it, docs/handoff-health.md), ``clock_unknown``
  (both ends of its handoff recorded, the clocks not bounded), ``slow``
  (handoff or TTFT above ``--keep-slow``: a fixed duration, or a live
  percentile ``pNN`` of its (mode, dispatch, P/D pair) window; ``warmup``
  while that window has too few requests to say), ``ratio`` (a share
  ``--keep-ratio`` picked by trace id, so every process and collector that
  sees a piece of the request picks the same requests). Otherwise only the
  summary is stored (``keep = 'no'``).

This module only parses and checks the rule (the CLI flags and the
connector's ``kvlens_keep*`` keys); :mod:`kvtrace.store.keep` applies it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvrecord.durations import parse_duration

KEEP_MODES = ("all", "sampled")
#: Why a request's spans are kept, first match wins (then ``no``: summary only).
KEEP_REASONS = ("failed", "timeout", "expired", "stale", "clock_unknown", "slow", "warmup", "ratio")
#: The decision of a request kept only as its summary.
NOT_KEPT = "no"

DEFAULT_RATIO = 0.01
#: p99, not p90: slow is "handoff OR TTFT above its percentile", so p90
#: keeps ~19 % of requests (measured: 27 % with the windows' warm-up, in
#: benchmarks/bench_fleetsim.py), p99 ~2 %: with the 1 % ratio, ~3 % of
#: requests kept whole.
DEFAULT_SLOW = "p99"
#: How long a request's spans wait for the rest of the request before it is
#: decided (from its first span); a request whose router root span has
#: arrived is decided :attr:`KeepRule.grace_s` after it instead.
DEFAULT_WAIT_S = 10.0
DEFAULT_GRACE_S = 2.0
#: Spans held while their request is undecided, at most; past it the oldest
#: requests are decided early (counted as ``forced``).
DEFAULT_MAX_SPANS = 100_000

_PCT = re.compile(r"^p(\d+(?:\.\d+)?)$")
_MS = re.compile(r"^(\d+(?:\.\d+)?)ms$")


@dataclass(frozen=True)
class KeepRule:
    """A checked keep rule. ``slow_pct``: the percentile (0-100, exclusive)
    of the request's window above which it is slow; ``slow_s``: a fixed
    threshold instead (exactly one of the two is set)."""

    mode: str = "all"
    ratio: float = DEFAULT_RATIO
    slow_pct: float | None = 99.0
    slow_s: float | None = None
    wait_s: float = DEFAULT_WAIT_S
    grace_s: float = DEFAULT_GRACE_S
    max_spans: int = DEFAULT_MAX_SPANS

    @property
    def sampled(self) -> bool:
        return self.mode == "sampled"

    @classmethod
    def parse(
        cls, keep: Any = None, ratio: Any = None, slow: Any = None, *, prefix: str = "--keep", **kw: Any
    ) -> "KeepRule":
        """The rule from its three options as typed (None: the default).
        ValueError naming the option (``{prefix}``, ``{prefix}-ratio``,
        ``{prefix}-slow``; the connector's keys are ``kvlens_keep*``)."""
        sep = "_" if prefix.startswith("kvlens") else "-"
        mode = "all" if keep is None else str(keep).strip().lower()
        if mode not in KEEP_MODES:
            raise ValueError(f"{prefix} must be one of {', '.join(KEEP_MODES)}, got {keep!r}")
        r = DEFAULT_RATIO if ratio is None else _ratio(ratio, f"{prefix}{sep}ratio")
        pct, secs = _slow(DEFAULT_SLOW if slow is None else slow, f"{prefix}{sep}slow")
        return cls(mode=mode, ratio=r, slow_pct=pct, slow_s=secs, **kw)

    def describe(self) -> str:
        """One line for start-up logs: what is kept."""
        if not self.sampled:
            return "keep all: every request's spans are stored"
        slow = f"p{self.slow_pct:g} of its window" if self.slow_pct is not None else f"{self.slow_s:g} s"
        return (
            f"keep sampled: summaries of every request; spans of failed, clock-unknown and slow "
            f"(handoff or TTFT above {slow}) requests and {self.ratio:.4g} of the rest"
        )

    def to_config(self) -> dict[str, Any]:
        """The ``kvlens_keep*`` keys :meth:`parse` rebuilds this rule from."""
        slow = f"p{self.slow_pct:g}" if self.slow_pct is not None else f"{self.slow_s!r}s"
        return {"kvlens_keep": self.mode, "kvlens_keep_ratio": self.ratio, "kvlens_keep_slow": slow}


def _ratio(v: Any, flag: str) -> float:
    try:
        r = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} must be a number from 0 to 1, got {v!r}") from None
    if not 0.0 <= r <= 1.0:  # NaN fails this too
        raise ValueError(f"{flag} must be from 0 to 1, got {v!r}")
    return r


def _slow(v: Any, flag: str) -> tuple[float | None, float | None]:
    """(percentile, None) for ``pNN``; (None, seconds) for a duration (``500ms``, ``2s``, a number of seconds)."""
    text = str(v).strip().lower()
    m = _PCT.match(text)
    if m:
        pct = float(m.group(1))
        if not 0.0 < pct < 100.0:
            raise ValueError(f"{flag} percentile must be between p0 and p100 (exclusive), got {v!r}")
        return pct, None
    m = _MS.match(text)
    try:
        secs = float(m.group(1)) / 1000.0 if m else parse_duration(text)
    except ValueError:
        raise ValueError(
            f"{flag} must be a percentile such as p90 or a duration such as 500ms / 2s, got {v!r}"
        ) from None
    if not secs > 0:
        raise ValueError(f"{flag} must be > 0, got {v!r}")
    return None, float(secs)
