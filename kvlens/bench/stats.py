"""Small statistics over client figures (pure). None entries are ignored;
an empty input gives None, never an exception. :func:`bootstrap_ratio`
gives the confidence interval of a push/pull ratio over rounds and requests."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence


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


#: Fewest requests with a figure per side for a bootstrap interval.
MIN_REQUESTS = 2
#: Bootstrap resamples: enough for stable 2.5/97.5 percentiles, a few ms of numpy.
RESAMPLES = 2000


def _clean_rounds(rounds: Sequence[Iterable[float | None]]) -> list:
    """Each round's non-None values as a float array; rounds with none dropped
    (a round with no figure carries no information about the figure)."""
    import numpy as np  # here for start-up cost: `kvlens --help` imports this module

    arrays = [np.asarray([v for v in r if v is not None], dtype=float) for r in rounds]
    return [a for a in arrays if a.size]


def _resampled_percentile(rounds: list, q: float, resamples: int, gen) -> "Any":
    """One q-th percentile per resample of a two-level bootstrap: draw as many
    rounds as there are, with replacement, then within each drawn round as
    many requests as it has, with replacement, and pool them. Vectorized:
    the drawn requests sit in a (resamples, rounds x longest round) array,
    NaN-padded where a drawn round is shorter than the longest."""
    import numpy as np

    sizes = np.array([a.size for a in rounds])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    flat = np.concatenate(rounds)
    k, longest = len(rounds), int(sizes.max())
    pick = gen.integers(0, k, size=(resamples, k))  # rounds, with replacement
    n = sizes[pick][..., None]  # (resamples, k, 1): the drawn round's size
    within = (gen.random((resamples, k, longest)) * n).astype(np.int64)  # < n: always inside the drawn round
    vals = np.where(np.arange(longest) < n, flat[starts[pick][..., None] + within], np.nan)
    return np.nanpercentile(vals.reshape(resamples, -1), q, axis=1)


def bootstrap_ratio(
    num_rounds: Sequence[Iterable[float | None]],
    den_rounds: Sequence[Iterable[float | None]],
    q: float = 50.0,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float] | None:
    """A ``level`` percentile-bootstrap confidence interval for
    percentile_q(num) / percentile_q(den), each side given as its rounds
    (lists of per-request figures; None entries ignored).

    Two levels, as the data were made: rounds (stack starts, or stretches of
    time) differ from each other more than requests within a round do, so
    each resample draws rounds with replacement and then requests within
    each drawn round, for each side independently. With one round this is
    the ordinary bootstrap over requests, and the interval covers only the
    variation between requests. The seed is fixed: the same figures give
    the same interval. None when a side has fewer than :data:`MIN_REQUESTS`
    figures, or the denominator's resampled percentile is mostly 0."""
    import numpy as np

    num, den = _clean_rounds(num_rounds), _clean_rounds(den_rounds)
    if sum(a.size for a in num) < MIN_REQUESTS or sum(a.size for a in den) < MIN_REQUESTS:
        return None
    gen = np.random.default_rng(seed)
    a = _resampled_percentile(num, q, resamples, gen)
    b = _resampled_percentile(den, q, resamples, gen)
    ok = b > 0
    if ok.sum() < resamples / 2:
        return None
    r = a[ok] / b[ok]
    lo, hi = np.percentile(r, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(lo), float(hi)
