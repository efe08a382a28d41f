"""Pure loaders for the per-(P, D) pair view: plain arguments in, pandas
out, no Streamlit (``dashboard/loaders.py`` caches them, the pages draw).

With several prefill and decode instances, a mode's percentiles mix every
pair: one slow P or D (a busy GPU, a far NIC, a clock that drifts) hides
in them. Here each (mode, P engine, D engine) gets its own row: requests,
handoff p50 / p90 with the pair's typical clock bound, TTFT p50, and the
pair's clock window (D's clock minus P's, as the store settled the pair's
newest trace: each pair has its own, :mod:`kvtrace.clockbounds`).

Apart from :mod:`dashboard.data` only because that file is at its size
limit; the same rules (the store's API, read-only, no SQL here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pandas as pd

from kvtrace import store
from kvtrace.store import queries
from kvrecord import semconv as sc

#: Newest traces of the range the pair figures are computed over.
PAIR_LIMIT = 200_000
#: What a pair's side shows when its engine id was never recorded.
UNKNOWN_ENGINE = "?"

PAIR_TABLE_COLUMNS = [
    "mode",
    "pair",
    "p_engine",
    "d_engine",
    "requests",
    "handoffs",
    "handoff_p50_s",
    "handoff_p90_s",
    "err_p50_s",
    "ttft_p50_s",
    "vs_best",
    "clock_lo_s",
    "clock_hi_s",
    "clock_offset_s",
    "link",
]

_MODE_RANK = {m.value: i for i, m in enumerate(sc.Mode)}


def pair_label(p_engine: str | None, d_engine: str | None) -> str:
    """``p0 → d0`` (``?`` for a side never recorded)."""
    return f"{p_engine or UNKNOWN_ENGINE} → {d_engine or UNKNOWN_ENGINE}"


def engine_pairs(path: str | Path) -> list[tuple[str | None, str | None]]:
    """The (P engine, D engine) pairs the store has seen, sorted."""
    with store.reading(path) as c:
        return queries.engines(c)


def pair_link(mode: str | None, p_engine: str | None, d_engine: str | None) -> str:
    """Relative link to the Traces page filtered to one pair (and mode)."""
    q = {k: v for k, v in (("mode", mode), ("p_engine", p_engine), ("d_engine", d_engine)) if v}
    return f"./?{urlencode({'page': 'traces', **q})}"


def _q(s: pd.Series, q: float) -> float | None:
    s = s.dropna()
    return float(s.quantile(q)) if len(s) else None


def pair_frame(path: str | Path, since_ns: int | None, until_ns: int | None, limit: int = PAIR_LIMIT) -> pd.DataFrame:
    """The range's traces with their engines and clock windows (columns
    ``queries.PAIR_COLUMNS``), newest first."""
    with store.reading(path) as c:
        rows = queries.pair_rows(c, since_ns=since_ns, until_ns=until_ns, limit=limit)
    return pd.DataFrame.from_records(rows, columns=list(queries.PAIR_COLUMNS))


def pair_stats(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (mode, P engine, D engine) of :func:`pair_frame` rows
    (columns :data:`PAIR_TABLE_COLUMNS`; seconds), slowest handoff p50 first
    within a mode. ``err_p50_s``: the median clock bound (±) of the pair's
    known handoffs; ``vs_best``: its handoff p50 over the fastest pair's of
    the same mode (1.0: the fastest); ``clock_*``: the window of the pair's
    newest trace that has one (``clock_offset_s``: the correction applied,
    0 when the window contains 0); ``link``: its traces on the Traces page."""
    if not len(df):
        return pd.DataFrame(columns=PAIR_TABLE_COLUMNS)
    keyed = df.assign(_p=df["p_engine"].fillna(""), _d=df["d_engine"].fillna(""))
    out = []
    for (mode, p, d), g in keyed.groupby(["mode", "_p", "_d"], sort=False, dropna=False):
        known = g.dropna(subset=["handoff_s"])
        win = g.dropna(subset=["clock_lo_s", "clock_hi_s"]).sort_values("start_ns", ascending=False).head(1)
        w = win.iloc[0] if len(win) else None
        out.append(
            {
                "mode": mode,
                "pair": pair_label(p or None, d or None),
                "p_engine": p or None,
                "d_engine": d or None,
                "requests": len(g),
                "handoffs": len(known),
                "handoff_p50_s": _q(known["handoff_s"], 0.5),
                "handoff_p90_s": _q(known["handoff_s"], 0.9),
                "err_p50_s": _q(known["handoff_err_s"], 0.5),
                "ttft_p50_s": _q(g["ttft_s"], 0.5),
                "clock_lo_s": None if w is None else float(w["clock_lo_s"]),
                "clock_hi_s": None if w is None else float(w["clock_hi_s"]),
                "clock_offset_s": None if w is None or pd.isna(w["clock_offset_s"]) else float(w["clock_offset_s"]),
                "link": pair_link(mode, p or None, d or None),
            }
        )
    res = pd.DataFrame(out)
    best = res.groupby("mode")["handoff_p50_s"].transform("min")
    res["vs_best"] = (res["handoff_p50_s"] / best.where(best > 0)).astype(float)
    res["_rank"] = res["mode"].map(lambda m: _MODE_RANK.get(m, len(_MODE_RANK)))
    res = res.sort_values(["_rank", "handoff_p50_s", "pair"], ascending=[True, False, True], na_position="last")
    return res[PAIR_TABLE_COLUMNS].reset_index(drop=True)


def pair_table(path: str | Path, since_ns: int | None, until_ns: int | None, limit: int = PAIR_LIMIT) -> pd.DataFrame:
    """:func:`pair_stats` over the traces that started in [since_ns, until_ns]."""
    return pair_stats(pair_frame(path, since_ns, until_ns, limit))


def clock_window_text(lo_s: Any, hi_s: Any) -> str | None:
    """``[+0.12, +0.45]`` (ms, D's clock minus P's), or None when unknown."""
    if lo_s is None or hi_s is None or pd.isna(lo_s) or pd.isna(hi_s):
        return None
    return f"[{lo_s * 1e3:+.2f}, {hi_s * 1e3:+.2f}]"
