"""The dashboard's cached loaders: each wraps a pure loader of
:mod:`dashboard.data` / :mod:`dashboard.prom` in ``st.cache_data`` so that
reruns and several sessions share one load per time step.

Windowed loads take ``now_s`` from :func:`now_bucket`, so a cache entry
holds for one step (seconds) and then the window moves on. The loaders run
on Streamlit's script thread and block for the load (a whole store: ~1 s).
"""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import streamlit as st

from dashboard import benchdata
from dashboard import data
from dashboard import handoffhealth
from dashboard import pairs, prom
from kvtrace import benchrows
from kvtrace.store import StoreLocation

#: Time-to-live (seconds) of live loads, and the step of :func:`now_bucket` for short ranges.
CACHE_TTL_S = 5


def now_bucket(range_key: str | None = None) -> int:
    """Current time (s) rounded down to a step, so windowed loads share a cache
    entry. Wide ranges (a whole store can be 100k+ traces, ~1 s to load)
    refresh less often than the live ones."""
    secs = data.TIME_RANGES.get(range_key) if range_key else 0
    step = CACHE_TTL_S if secs is not None and secs <= 3600 else 30 if secs and secs <= 86400 else 60
    return int(time.time() // step) * step


def ratio_column(metric: str) -> str:
    """The bench table's column of a metric's push/pull ratio: ``handoff_p50_s`` -> ``handoff_p50 push÷pull``."""
    return f"{metric.removesuffix('_s')} push÷pull"


def with_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` (bench rows) plus a :func:`ratio_column` per ``benchrows.RATIO_METRICS``:
    the push figure over the pull figure of the same cell (the one rule,
    :func:`kvtrace.benchrows.push_over_pull`); NaN on pull rows and where
    there is no ratio. < 1: push wins."""
    out = df.copy()
    ratios = benchrows.push_over_pull(df.to_dict("records"))
    for m in benchrows.RATIO_METRICS:
        vals = pd.Series([r[m] for r in ratios], index=out.index, dtype="object")
        out[ratio_column(m)] = pd.to_numeric(vals, errors="coerce")
    return out


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def load_info(path: StoreLocation, _bucket: int) -> dict[str, Any]:
    return data.store_info(path)


@st.cache_data(ttl=60, max_entries=16, show_spinner=False)
def load_window(path: StoreLocation, range_key: str, now_s: int) -> pd.DataFrame:
    since, until = data.since_until(range_key, now_s)
    return data.window_traces(path, since, until)


@st.cache_data(ttl=60, max_entries=16, show_spinner=False)
def load_phases(path: StoreLocation, range_key: str, now_s: int) -> pd.DataFrame:
    since, until = data.since_until(range_key, now_s)
    return data.phase_breakdown(path, since, until)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def load_prometheus(url: str, range_key: str, _bucket: int):
    return prom.prom_overview(url, range_key)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def load_slowest(
    path: StoreLocation,
    n: int,
    mode: str | None,
    outcome: str | None,
    range_key: str,
    now_s: int,
    min_h: float | None,
    max_h: float | None,
    order: str,
    p_engine: str | None = None,
    d_engine: str | None = None,
) -> pd.DataFrame:
    since, until = data.since_until(range_key, now_s)
    return data.slowest(
        path,
        n,
        mode=mode,
        outcome=outcome,
        since_ns=since,
        until_ns=until,
        min_handoff_s=min_h,
        max_handoff_s=max_h,
        order=order,
        p_engine=p_engine,
        d_engine=d_engine,
    )


@st.cache_data(ttl=60, max_entries=16, show_spinner=False)
def load_pairs(path: StoreLocation, range_key: str, now_s: int) -> pd.DataFrame:
    since, until = data.since_until(range_key, now_s)
    return pairs.pair_table(path, since, until)


@st.cache_data(ttl=30, show_spinner=False)
def load_engines(path: StoreLocation, _bucket: int) -> list[tuple[str | None, str | None]]:
    return pairs.engine_pairs(path)


@st.cache_data(ttl=60, show_spinner=False)
def load_trace(path: StoreLocation, trace_id: str):
    return data.trace_detail(path, trace_id)


@st.cache_data(ttl=30, show_spinner=False)
def load_bench_runs(path: StoreLocation, _bucket: int) -> list[dict[str, Any]]:
    return benchdata.bench_runs(path)


@st.cache_data(ttl=30, show_spinner=False)
def load_bench(path: StoreLocation, run_id: str | None) -> pd.DataFrame:
    return with_ratios(benchdata.bench_table(path, run_id))


@st.cache_data(ttl=60, max_entries=4, show_spinner=False)
def load_verdict(path: StoreLocation, since_ns: int | None):
    return data.verdict_of(path, since_ns)


@st.cache_data(ttl=60, max_entries=16, show_spinner=False)
def load_whatif(path: StoreLocation, since_ns: int | None, from_mode: str):
    return data.whatif_of(path, since_ns, from_mode)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def load_prom_health(url: str, range_key: str, _bucket: int) -> dict[str, handoffhealth.Figure]:
    return prom.prom_health(url, range_key)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def load_stuck(path: StoreLocation, now_s: int) -> pd.DataFrame:
    return handoffhealth.stuck_table(path, now_s * 1_000_000_000)
