"""Durations as users type them (``30s``, ``10m``, ``2h``, ``7d``, or plain
seconds): one parser for every flag and option that takes one
(``--since``, ``--retention``, ``kvlens_retention``, ...)."""

from __future__ import annotations

import math

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, *, max_s: float = math.inf) -> float:
    """``text`` in seconds, finite and in (0, ``max_s``]; ValueError naming
    the text otherwise."""
    t = str(text).strip().lower()
    try:
        secs = float(t[:-1]) * UNITS[t[-1]] if t and t[-1] in UNITS else float(t)
    except ValueError:
        raise ValueError(f"invalid duration {text!r}: use e.g. 30s, 10m, 2h, 1d") from None
    if not math.isfinite(secs) or secs <= 0:
        raise ValueError(f"invalid duration {text!r}: must be > 0")
    if secs > max_s:
        raise ValueError(f"invalid duration {text!r}: at most {max_s / 86400:g}d")
    return secs
