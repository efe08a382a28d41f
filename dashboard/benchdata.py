"""The bench's side of the dashboard, pure (no Streamlit): a bench run's
rows from the store, TPOT per mode from them, and the live window's push vs
pull figures in the same shape as a bench row (the Compare page)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from dashboard.data import MODES, ModeStats
from kvtrace import benchrows, store


def bench_runs(path: str | Path) -> list[dict[str, Any]]:
    """Bench runs in the store, newest first: run_id, created_ns, rows."""
    with store.reading(path) as c:
        return store.bench_runs(c)


def bench_table(path: str | Path, run_id: str | None = None) -> pd.DataFrame:
    """One bench run's rows (latest by default), columns ``benchrows.ROW_KEYS``."""
    with store.reading(path) as c:
        rows = store.bench_rows(c, run_id)
    cols = list(benchrows.ROW_KEYS)
    df = pd.DataFrame([{k: r.get(k) for k in cols} for r in rows], columns=cols)
    for k in cols[4:]:
        df[k] = pd.to_numeric(df[k], errors="coerce")
    return df


def bench_tpot(df: pd.DataFrame, run_id: str | None) -> dict[str, tuple[float | None, str]]:
    """Per mode, (mean TPOT over a bench run's cells, where it comes from or why it is
    missing): the trace store has no per-request TPOT, its bench rows do."""
    out = {}
    for mode in MODES:
        v = (
            pd.to_numeric(df.loc[df["mode"] == mode, "tpot_mean_s"], errors="coerce").dropna()
            if len(df)
            else pd.Series(dtype=float)
        )
        if len(v):
            out[mode] = (
                float(v.mean()),
                f"Mean TPOT over the {len(v)} {mode} cells of bench run {run_id} "
                "(kvlens bench), not over this time range.",
            )
        elif run_id:
            out[mode] = (
                None,
                f"Bench run {run_id} has no {mode} TPOT (unknown when tokens arrive together); "
                "the trace store records no per-request TPOT.",
            )
        else:
            out[mode] = (
                None,
                "The trace store records no per-request TPOT and holds no bench run; run "
                "`kvlens bench`, or give --prometheus to read vLLM's TPOT from D.",
            )
    return out


def live_compare(stats: Mapping[str, ModeStats]) -> pd.DataFrame:
    """Live-window push vs pull table, one row per mode. No ratio row: a
    ratio of two percentiles without its interval is no comparison, and one of
    request counts is none at all (the Compare page shows the verdict's)."""
    rows = []
    for mode in MODES:
        s = stats.get(mode)
        if s is None:
            continue
        rows.append(
            {
                "mode": mode,
                "requests": s.requests,
                "req/s": s.req_per_s,
                "ttft_mean_s": s.ttft.get("mean"),
                "ttft_p50_s": s.ttft.get("p50"),
                "ttft_p99_s": s.ttft.get("p99"),
                "tpot_mean_s": s.tpot_mean,
                "handoff_p50_s": s.handoff.get("p50"),
                "handoff_p90_s": s.handoff.get("p90"),
                "handoff_p99_s": s.handoff.get("p99"),
            }
        )
    return pd.DataFrame(rows)
