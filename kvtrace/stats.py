"""Small statistics over per-request figures (pure). None entries are
ignored; an empty input gives None, never an exception.
:func:`bootstrap_ratio` gives the confidence interval of a push/pull ratio
over rounds and requests (``kvlens bench``); :func:`stratified_ratio` the
interval of a ratio compared like with like, stratum by stratum, pooled by
the strata's weights (``kvlens verdict``, the dashboard's headline). Both
read stored or measured figures only: the CLI and the dashboard call the
same functions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence


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


def _resampled_pair(a_rounds, b_rounds, q: float, resamples: int, seed: int):
    """Both sides' resampled percentiles (:func:`_resampled_percentile`, one seeded generator, ``a`` first);
    None when a side has fewer than :data:`MIN_REQUESTS` figures."""
    import numpy as np

    a, b = _clean_rounds(a_rounds), _clean_rounds(b_rounds)
    if sum(x.size for x in a) < MIN_REQUESTS or sum(x.size for x in b) < MIN_REQUESTS:
        return None
    gen = np.random.default_rng(seed)
    return _resampled_percentile(a, q, resamples, gen), _resampled_percentile(b, q, resamples, gen)


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

    pair = _resampled_pair(num_rounds, den_rounds, q, resamples, seed)
    if pair is None:
        return None
    a, b = pair
    ok = b > 0
    if ok.sum() < resamples / 2:
        return None
    r = a[ok] / b[ok]
    lo, hi = np.percentile(r, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(lo), float(hi)


def bootstrap_diff(
    a_rounds: Sequence[Iterable[float | None]],
    b_rounds: Sequence[Iterable[float | None]],
    q: float = 50.0,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float] | None:
    """A ``level`` percentile-bootstrap confidence interval for
    percentile_q(a) - percentile_q(b), resampled as :func:`bootstrap_ratio`
    resamples (rounds, then requests within them; the seed fixed). For
    figures near 0, where a ratio says nothing (a CPU wait's rise). None when
    a side has fewer than :data:`MIN_REQUESTS` figures."""
    import numpy as np

    pair = _resampled_pair(a_rounds, b_rounds, q, resamples, seed)
    if pair is None:
        return None
    d = pair[0] - pair[1]
    lo, hi = np.percentile(d, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(lo), float(hi)


def sampling_floor(
    values: Iterable[float | None],
    n_a: int | None = None,
    n_b: int | None = None,
    q: float = 50.0,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> float | None:
    """How far apart two samples' q-th percentiles lie from sampling alone,
    relative to ``values``' own: the median over ``resamples`` of
    |p(A) - p(B)| / p(values), A (``n_a`` requests) and B (``n_b``) drawn
    independently, with replacement, from ``values`` (both default to its
    size). A prediction that knew the distribution exactly but saw it
    through ``n_b`` requests would miss ``n_a`` measured ones by about this
    much: a smaller error is not resolvable (the what-if's floor,
    docs/verdict.md). None with fewer than :data:`MIN_REQUESTS` figures or a
    percentile of 0."""
    import numpy as np

    xs = _clean(values)
    if xs.size < MIN_REQUESTS:
        return None
    mid = float(np.percentile(xs, q))
    if mid == 0:
        return None
    gen = np.random.default_rng(seed)
    a, b = (_resampled_stat(xs, q, resamples, gen, n) for n in (n_a, n_b))
    return float(np.median(np.abs(a - b)) / abs(mid))


# ------------------------------------------------------------- stratified
#: Fewest figures per side in a stratum for it to enter a stratified ratio:
#: below it a stratum's percentile (p90 of 10 requests is its 9th) says
#: little, and its bootstrap even less.
MIN_PER_STRATUM = 10
#: The three answers a stratified ratio can give.
RESOLVED = "resolved"
NO_DIFFERENCE = "no resolvable difference"
NOT_ENOUGH = "not enough data"
#: Most resampled figures held at once (resamples x a stratum's size): a large
#: stratum is resampled in chunks so memory stays bounded (~32 MB of float64).
_MAX_CELLS = 4_000_000


@dataclass(frozen=True)
class Stratum:
    """One stratum of a :class:`StratifiedRatio`: its figures per side, its
    weight in the pooled ratio (0 when it has too few figures) and its own ratio."""

    name: str
    n_num: int
    n_den: int
    weight: float = 0.0
    ratio: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "n_num": self.n_num, "n_den": self.n_den, "weight": self.weight, "ratio": self.ratio}


@dataclass(frozen=True)
class StratifiedRatio:
    """A ratio num/den of one statistic, pooled over strata (see
    :func:`stratified_ratio`): the point ratio, its interval at ``level``,
    the answer (:data:`RESOLVED`, :data:`NO_DIFFERENCE` or :data:`NOT_ENOUGH`)
    and why, and every stratum with its counts and weight."""

    status: str
    ratio: float | None = None
    lo: float | None = None
    hi: float | None = None
    level: float = 0.95
    strata: tuple[Stratum, ...] = ()
    note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "ratio": self.ratio,
            "interval": None if self.lo is None else [self.lo, self.hi],
            "level": self.level,
            "note": self.note,
            "strata": [s.to_json() for s in self.strata],
            **self.extra,
        }


def _clean(values: Iterable[float | None]) -> "Any":
    import numpy as np

    return np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)


def _resampled_stat(xs: "Any", q: float, resamples: int, gen, n: int | None = None) -> "Any":
    """The q-th percentile of ``resamples`` resamples of ``xs`` (with
    replacement; ``n`` draws each, default its size), in bounded chunks."""
    import numpy as np

    n = n or xs.size
    chunk = max(1, _MAX_CELLS // max(n, 1))
    out = [
        np.percentile(xs[gen.integers(0, xs.size, size=(min(chunk, resamples - i), n))], q, axis=1)
        for i in range(0, resamples, chunk)
    ]
    return np.concatenate(out)


def stratified_ratio(
    num: Mapping[str, Iterable[float | None]],
    den: Mapping[str, Iterable[float | None]],
    q: float = 50.0,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
    min_per_stratum: int = MIN_PER_STRATUM,
) -> StratifiedRatio:
    """percentile_q(num) / percentile_q(den) compared like with like.

    ``num`` and ``den`` map a stratum's name (a prompt-length bucket) to its
    figures on each side. Each stratum with at least ``min_per_stratum``
    figures on both sides gets its own ratio; the pooled ratio is their
    weighted geometric mean, each stratum weighted by its share of the
    figures (both sides together) among those strata. A shift of the mix
    between the sides (more short prompts on one) then cannot pass for a
    difference between them: the pooled ratio compares each side at the
    same mix. The interval: each stratum's two sides resampled
    independently (with replacement, as many as it has), the pooled ratio
    recomputed, ``resamples`` times; the weights stay as observed. The
    answer is :data:`NO_DIFFERENCE` where the interval holds 1,
    :data:`NOT_ENOUGH` where no stratum has enough figures (or the
    statistic is 0 on a side), :data:`RESOLVED` otherwise. The seed is
    fixed: the same figures give the same interval."""
    import numpy as np

    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    names = list(dict.fromkeys([*num, *den]))  # in the order given
    clean = {k: (_clean(num.get(k, ())), _clean(den.get(k, ()))) for k in names}
    ok = [k for k in names if min(a.size for a in clean[k]) >= min_per_stratum]
    points = {k: (np.percentile(clean[k][0], q), np.percentile(clean[k][1], q)) for k in ok}
    ok = [k for k in ok if points[k][0] > 0 and points[k][1] > 0]
    total = sum(clean[k][0].size + clean[k][1].size for k in ok)
    w = {k: (clean[k][0].size + clean[k][1].size) / total for k in ok}
    strata = tuple(
        Stratum(
            k, int(clean[k][0].size), int(clean[k][1].size), w.get(k, 0.0), _ratio(points.get(k)) if k in w else None
        )
        for k in names
    )
    if not ok:
        why = f"no stratum has {min_per_stratum} figures on both sides"
        return StratifiedRatio(NOT_ENOUGH, level=level, strata=strata, note=why)
    point = float(np.exp(sum(w[k] * np.log(points[k][0] / points[k][1]) for k in ok)))
    gen = np.random.default_rng(seed)
    logs = np.zeros(resamples)
    for k in ok:
        a = _resampled_stat(clean[k][0], q, resamples, gen)
        b = _resampled_stat(clean[k][1], q, resamples, gen)
        with np.errstate(divide="ignore", invalid="ignore"):
            logs += w[k] * np.log(a / b)
    good = logs[np.isfinite(logs)]
    if good.size < resamples / 2:
        return StratifiedRatio(NOT_ENOUGH, level=level, strata=strata, note="the statistic is mostly 0 when resampled")
    lo, hi = (float(np.exp(v)) for v in np.percentile(good, [(1 - level) / 2 * 100, (1 + level) / 2 * 100]))
    status = NO_DIFFERENCE if lo <= 1.0 <= hi else RESOLVED
    return StratifiedRatio(status, point, lo, hi, level, strata)


def _ratio(pair) -> float | None:
    return None if pair is None else float(pair[0] / pair[1])
