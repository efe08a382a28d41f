"""Small statistics over client figures (pure). None entries are ignored;
an empty input gives None, never an exception."""

from __future__ import annotations

import math
from typing import Iterable


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest
    ranks (numpy's default); None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Iterable[float | None]) -> float | None:
    """Arithmetic mean of the non-None values."""
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def rel_diff(a: float | None, b: float | None) -> float | None:
    """|a - b| / b (None when undefined)."""
    if a is None or b is None or b <= 0:
        return None
    return abs(a - b) / b
