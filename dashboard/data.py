"""Pure data loaders for the dashboard: plain arguments in, pandas / plain
objects out, no Streamlit. ``dashboard/loaders.py`` wraps them in
``st.cache_data(ttl=...)``; the pages and ``dashboard/charts.py`` draw
(docs/architecture.md: data apart from drawing).

Sources
-------
* The trace store (:mod:`kvtrace.store`, through its API: no SQL here),
  always opened read-only, one short-lived connection per load (opening a
  SQLite file costs ~0.1 ms, and a store that appears or is replaced while
  the dashboard runs is just picked up). Traces and the critical-path split
  come from :mod:`kvtrace.tracemodel`, as in ``kvlens traces``.
* Prometheus (``--prometheus URL``): in :mod:`dashboard.prom`, through the
  one HTTP client :mod:`exporters.promapi`.

Errors are raised as :class:`StoreMissing` or :class:`StoreError` (the
store's own classes); the pages turn them into
a message, never a traceback.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pandas as pd

from dashboard import cpushare
from kvtrace import costs, ranks, store, tracemodel
from kvtrace import verdict as kv_verdict
from kvtrace import whatif as kv_whatif
from kvrecord import semconv as sc

MODES: tuple[str, ...] = tuple(m.value for m in sc.Mode)
OUTCOMES: tuple[str, ...] = tuple(o.value for o in sc.Outcome)
ROLE_ORDER: dict[str, int] = {r.value: i for i, r in enumerate(sc.Role)}

#: Time-range picker choices -> seconds (None: everything in the store).
TIME_RANGES: dict[str, int | None] = {
    "5m": 300,
    "15m": 900,
    "1h": 3600,
    "6h": 6 * 3600,
    "24h": 86400,
    "7d": 7 * 86400,
    "all": None,
}

#: Newest traces (in the window) loaded for live statistics; beyond this the
#: figures are over the newest ones only, and the page says so.
WINDOW_LIMIT = 200_000
#: Newest completed traces whose spans feed the per-phase breakdown.
PHASE_SAMPLE = 5_000

#: Stacked-bar label for handoff time no phase accounts for. Not a Phase
#: (:data:`kvtrace.tracemodel.UNATTRIBUTED`).
UNATTRIBUTED = tracemodel.UNATTRIBUTED

CRITICAL, OVERLAP = tracemodel.CRITICAL, tracemodel.OVERLAP

#: The trace store file does not exist (yet).
StoreMissing = store.StoreMissing
#: The store exists but cannot be read (not a kvlens store, corrupt, locked, too new).
StoreError = store.StoreError


# ------------------------------------------------------------------ colours
# One fixed colour per Phase value (plus "unattributed"), so a phase has the
# same colour on every chart and in every trace.
_PALETTE = (
    "#4c78a8",
    "#9ecae9",
    "#f58518",
    "#ffbf79",
    "#54a24b",
    "#88d27a",
    "#b79a20",
    "#f2cf5b",
    "#439894",
    "#83bcb6",
    "#e45756",
    "#ff9d98",
    "#79706e",
    "#bab0ac",
    "#d67195",
    "#fcbfd2",
    "#b279a2",
    "#d6a5c9",
    "#9e765f",
    "#d8b5a5",
    "#1f77b4",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#17becf",
    "#bcbd22",
)


def phase_colors() -> tuple[list[str], list[str]]:
    """(domain, range) for altair's colour scale: every Phase in display order, then ``unattributed``,
    then a partial trace's ``handoff.open`` (red: still waiting)."""
    domain = sorted(sc.PHASE_ORDER, key=sc.PHASE_ORDER.get) + [UNATTRIBUTED, sc.SPAN_HANDOFF_OPEN]
    rng = [_PALETTE[i % len(_PALETTE)] for i in range(len(domain) - 2)] + ["#c7c7c7", "#d62728"]
    return domain, rng


def phase_rank(name: str) -> int:
    return sc.PHASE_ORDER.get(name, len(sc.PHASE_ORDER))


def since_until(range_key: str, now_s: float | None = None) -> tuple[int | None, int | None]:
    """Wall-clock ns bounds for a picker choice (``None`` = unbounded): the
    range back from ``now_s``, and no end (whatever has been written since)."""
    if range_key not in TIME_RANGES:
        raise ValueError(f"unknown time range {range_key!r} (choose from {list(TIME_RANGES)})")
    secs = TIME_RANGES[range_key]
    if secs is None:
        return None, None
    now_ns = int((time.time() if now_s is None else now_s) * 1e9)
    # No upper bound: ``now_s`` is a cache step (loaders.now_bucket) rounded down, and a window that
    # ended there hid the traces of the last few seconds: a page drawn just after the first requests
    # of a young store found none (issue 43 item 6).
    return now_ns - secs * 1_000_000_000, None


def traces_link(*, page: str = "traces", **params: Any) -> str:
    """Relative link to the Traces page with its filters pre-set (query params)."""
    q = {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in params.items() if v is not None}
    return f"./?{urlencode({'page': page, **q})}"


# -------------------------------------------------------------------- store
def store_info(path: str | Path) -> dict[str, Any]:
    """``{"traces": n, "first_ns", "last_ns", "bench_runs": n}``."""
    with store.reading(path) as c:
        return store.info(c)


def window_traces(
    path: str | Path, since_ns: int | None, until_ns: int | None, limit: int = WINDOW_LIMIT
) -> pd.DataFrame:
    """Traces that started in [since_ns, until_ns], newest first (at most
    ``limit``). Columns ``store.WINDOW_COLUMNS``."""
    with store.reading(path) as c:
        rows = store.window(c, since_ns=since_ns, until_ns=until_ns, limit=limit)
    return pd.DataFrame.from_records(rows, columns=list(store.WINDOW_COLUMNS))


@dataclass
class ModeStats:
    """Live figures for one mode (store- or Prometheus-derived). Seconds; None = n/a."""

    mode: str
    requests: float | None = None
    req_per_s: float | None = None
    handoff: dict[str, float | None] = field(default_factory=dict)  # p50 / p90 / p99
    ttft: dict[str, float | None] = field(default_factory=dict)  # mean / p50 / p99
    #: where the TTFT figures come from: "router" (client-seen at kvlens' router),
    #: "engines" (P's arrival -> D's first token, another router), both joined by "+", or "" (none)
    ttft_source: str = ""
    tpot_mean: float | None = None
    tpot_note: str = ""  # where tpot_mean comes from, or why it is missing
    outcomes: dict[str, float] = field(default_factory=dict)
    dropped: float | None = None
    dropped_by_reason: dict[str, float] = field(default_factory=dict)  # reason -> spans lost (Prometheus)
    #: the seconds ``req_per_s`` is over: the range, or the data's age where that is shorter (None: unknown)
    rate_window_s: float | None = None
    #: where the handoff and TTFT percentiles come from: "store" (exact, per request) or "histogram"
    pct_source: str = ""
    #: why the percentiles are not the store's exact ones (Prometheus' buckets), or ""
    pct_note: str = ""


def _q(s: pd.Series, q: float) -> float | None:
    s = s.dropna()
    return float(s.quantile(q)) if len(s) else None


def rate_window(window_s: float | None, first_ns: int | None, now_ns: int) -> float | None:
    """The seconds a rate over a range of ``window_s`` covers: the range, or
    the age of the data (``now_ns`` minus its first sample ``first_ns``) where
    that is shorter (at least 1 s); None when neither is known."""
    age = None if first_ns is None else max((now_ns - first_ns) / 1e9, 1.0)
    if window_s is None:
        return age
    return window_s if age is None else min(float(window_s), age)


def stats_from_traces(df: pd.DataFrame, window_s: float | None, now_ns: int | None = None) -> dict[str, ModeStats]:
    """Per-mode figures from :func:`window_traces` rows. Rates are over the
    range ``window_s`` back from ``now_ns`` (default now), or over the data's
    age (its first trace's start, both modes) where that is shorter, so a
    store 2 minutes old is not read as 2 minutes of traffic in an hour;
    ``window_s`` None: over the span of the data itself."""
    out: dict[str, ModeStats] = {}
    now_ns = time.time_ns() if now_ns is None else now_ns
    first_ns = int(df["start_ns"].min()) if len(df) else None
    for mode in MODES:
        d = df[df["mode"] == mode] if len(df) else df
        st = ModeStats(mode=mode, requests=float(len(d)), pct_source="store")
        if len(d):
            span_s = rate_window(window_s, first_ns, now_ns)
            if window_s is None:
                span_s = max((d["start_ns"].max() - d["start_ns"].min()) / 1e9, 1.0)
            st.req_per_s, st.rate_window_s = len(d) / span_s, span_s
        h = d["handoff_s"] if len(d) else pd.Series(dtype=float)
        t = d["ttft_s"] if len(d) else pd.Series(dtype=float)
        st.handoff = {"p50": _q(h, 0.5), "p90": _q(h, 0.9), "p99": _q(h, 0.99)}
        tt = t.dropna()
        st.ttft = {"mean": float(tt.mean()) if len(tt) else None, "p50": _q(t, 0.5), "p99": _q(t, 0.99)}
        if len(tt) and "ttft_source" in d:
            st.ttft_source = "+".join(sorted({v or "router" for v in d.loc[tt.index, "ttft_source"]}))
        counts = d["outcome"].value_counts().to_dict() if len(d) else {}
        st.outcomes = {o: float(counts.get(o, 0)) for o in OUTCOMES}
        out[mode] = st
    return out


#: A mode's percentiles come from the store when it holds at least this share of the requests Prometheus counted.
STORE_HOLDS = 0.9


def exact_from_store(
    prom_stats: dict[str, ModeStats],
    store_stats: dict[str, ModeStats] | None,
    why: str = "",
    df: pd.DataFrame | None = None,
    now_ns: int | None = None,
) -> None:
    """Replace the handoff and TTFT percentiles of ``prom_stats`` (interpolated
    within Prometheus' histogram buckets, which are 1-2.5 s wide past 1 s) with
    the trace store's exact ones (``store_stats``: :func:`stats_from_traces`
    over the same range), per mode, where the store holds that mode's requests
    (:data:`STORE_HOLDS`); elsewhere say why in ``pct_note``. ``why``: why the
    store could not be read, when it could not.

    Where the store holds them and ``df`` (the store's rows behind
    ``store_stats``) is given, the request rate counts the store's requests
    that started within Prometheus' own window (``rate_window_s``: the range,
    or the age of Prometheus' data where that is shorter; the store may hold
    older requests, e.g. the demo's grid). Prometheus' ``increase()``
    extrapolates a young series past its samples, and its first sample
    already holds the requests served before it, so a fleet two minutes old
    read +48 % against what it served; the store counts each request once."""
    for mode, p in prom_stats.items():
        s = (store_stats or {}).get(mode)
        n_prom, n_store = p.requests or 0.0, (s.requests or 0.0) if s else 0.0
        if s is not None and n_store >= 1 and n_store >= STORE_HOLDS * n_prom:
            p.handoff = dict(s.handoff)
            p.ttft = dict(s.ttft)
            p.ttft_source = s.ttft_source
            if df is not None and len(df) and p.rate_window_s:
                since = (time.time_ns() if now_ns is None else now_ns) - p.rate_window_s * 1e9
                p.req_per_s = int(((df["mode"] == mode) & (df["start_ns"] >= since)).sum()) / p.rate_window_s
            p.pct_source = "store"
            p.pct_note = (
                f"exact, over the {n_store:,.0f} {mode} requests the trace store holds in this range "
                f"(Prometheus counted {n_prom:,.0f})"
            )
            continue
        p.pct_source = "histogram"
        held = why or f"the trace store holds {n_store:,.0f} of the {n_prom:,.0f} {mode} requests Prometheus counted"
        p.pct_note = f"interpolated within Prometheus' histogram buckets ({held})"


def handoff_histogram(df: pd.DataFrame, bins: int = 24) -> pd.DataFrame:
    """Handoff histogram per mode on shared bins: mode, lo, hi, count, link."""
    cols = ["mode", "lo", "hi", "count", "link"]
    h = df.dropna(subset=["handoff_s"]) if len(df) else df
    h = h[h["mode"].isin(MODES)] if len(h) else h
    if not len(h):
        return pd.DataFrame(columns=cols)
    lo, hi = float(h["handoff_s"].min()), float(h["handoff_s"].max())
    # A few outliers must not squash the distribution into one bar: past the
    # 99.5th percentile everything lands in the last, open-ended bucket.
    q = float(h["handoff_s"].quantile(0.995))
    open_ended = hi > lo + 2 * (q - lo) and q > lo
    if open_ended:
        hi = q
    if hi <= lo:
        hi = lo + 1e-3
    width = (hi - lo) / bins
    edges = [lo + i * width for i in range(bins + 1)]
    rows = []
    for mode in MODES:
        v = h.loc[h["mode"] == mode, "handoff_s"]
        if not len(v):
            continue
        idx = ((v - lo) / width).astype(int).clip(0, bins - 1)
        counts = idx.value_counts()
        for i, n in counts.items():
            a, b = edges[i], edges[i + 1]
            # The last bucket's upper bound is exclusive in the store query: nudge it
            # (or drop it when the bucket collects the outliers).
            b_link = b if i < bins - 1 else None if open_ended else b * 1.000001 + 1e-9
            rows.append((mode, a, b, int(n), traces_link(mode=mode, min_handoff=a, max_handoff=b_link)))
    return pd.DataFrame(rows, columns=cols).sort_values(["mode", "lo"]).reset_index(drop=True)


def phase_breakdown(
    path: str | Path, since_ns: int | None, until_ns: int | None, sample: int = PHASE_SAMPLE
) -> pd.DataFrame:
    """Mean seconds per request that each (mode, role, phase) spends on the
    critical path (inside prefill.finished -> kv.ready) and overlapped with
    prefill (outside it), over the newest ``sample`` completed handoffs in
    the window. Columns: mode, role, phase, path, seconds, requests.

    The split is measured per span by :mod:`kvtrace.tracemodel` (the one
    rule, shared with the Traces page and ``kvlens traces``): in overlapped
    push the registration.* phases and most of ``match`` land before
    prefill.finished. Critical seconds are each phase's exclusive share of
    the window (derived phases included; overlapping spans never count
    twice), so a mode's bar adds up to its mean handoff, ``unattributed``
    being the part no named phase covers. ``df.attrs["words"]`` holds what
    dominates, per mode, in words (:func:`breakdown_words`).
    """
    with store.reading(path) as c:
        hc = costs.sample_costs(c, since_ns=since_ns, until_ns=until_ns, limit=sample)
    per_mode = hc.requests
    out = []
    for (mode, role, phase), (crit, over) in sorted(hc.phases.items(), key=lambda kv: str(kv[0])):
        cnt = per_mode.get(mode, (0, None))[0]
        if not cnt:
            continue
        crit_m, over_m = crit / cnt, over / cnt
        if crit_m > 0:
            out.append((mode, role, phase, CRITICAL, crit_m, cnt))
        if over_m > 0:
            out.append((mode, role, phase, OVERLAP, over_m, cnt))
    df = pd.DataFrame(out, columns=["mode", "role", "phase", "path", "seconds", "requests"])
    for mode, (cnt, mean_h) in per_mode.items():
        if mode not in MODES or mean_h is None:
            continue
        got = df.loc[(df["mode"] == mode) & (df["path"] == CRITICAL), "seconds"].sum()
        if mean_h - got > 1e-6:
            df.loc[len(df)] = (mode, "", UNATTRIBUTED, CRITICAL, mean_h - got, cnt)
    if len(df):
        df["rank"] = df["phase"].map(phase_rank)
        df = df.sort_values(["mode", "path", "rank"]).reset_index(drop=True)
    # plain JSON (Streamlit serializes attrs with the frame): the sentences, computed once here
    df.attrs["words"] = {m: tracemodel.dominant_words(hc.breakdown.get(m), m) for m in MODES}
    df.attrs["cpu"] = cpushare.cpu_attrs(hc, MODES)  # CPU or wire: the CPU-wait shares (dashboard.cpushare)
    return df


def breakdown_words(phases: pd.DataFrame) -> dict[str, str]:
    """Per mode, what dominates its handoff in one sentence
    (:func:`kvtrace.tracemodel.dominant_words`, as ``kvlens traces``
    prints it). From the store's tilings when :func:`phase_breakdown` made
    ``phases``; from the mean critical seconds otherwise (Prometheus: its
    durations may overlap, and no per-request median is known)."""
    words = dict(phases.attrs.get("words") or {}) if phases is not None else {}
    if words:
        return {m: words.get(m) or tracemodel.dominant_words(None, m) for m in MODES}
    groups: dict[str, tracemodel.Breakdown] = {}
    if phases is not None and len(phases):
        crit = phases[phases["path"] == CRITICAL]
        for mode, d in crit.groupby("mode"):
            n = pd.to_numeric(d["requests"], errors="coerce").max()
            n = int(n) if pd.notna(n) and n >= 1 else 1  # a mean per request: any count scales it alike
            named = {
                str(ph): int(sec * n * 1e9)
                for ph, sec in d.groupby("phase")["seconds"].sum().items()
                if ph != UNATTRIBUTED
            }
            total = int(d["seconds"].sum() * n * 1e9)
            groups[str(mode)] = tracemodel.Breakdown(
                str(mode), requests=n, handoff_ns=total, phases=named, handoff_known=UNATTRIBUTED in set(d["phase"])
            )
    return {m: tracemodel.dominant_words(groups.get(m), m) for m in MODES}


def slowest(
    path: str | Path,
    n: int = 50,
    *,
    order: str = "handoff",
    p_engine: str | None = None,
    d_engine: str | None = None,
    **filters: Any,
) -> pd.DataFrame:
    """The store's ``slowest`` as a DataFrame (columns ``store.SUMMARY_COLUMNS``, the
    trace summary's), on the engines given (None: any); ``filters``: the fields of
    :class:`kvtrace.store.TraceFilter`."""
    with store.reading(path) as c:
        rows = store.slowest(c, n, p_engine=p_engine or None, d_engine=d_engine or None, order=order, **filters)
    return pd.DataFrame(rows, columns=list(store.SUMMARY_COLUMNS))


def _attr_col(key: str) -> str:
    """Attribute key -> a DataFrame/altair-safe column name (no dots)."""
    k = key[len("kvlens.") :] if key.startswith("kvlens.") else key
    return "attr_" + k.replace(".", "_")


def trace_detail(path: str | Path, trace_id: str) -> tuple[dict[str, Any] | None, pd.DataFrame]:
    """(summary, spans) for one trace. ``summary`` is the ``--json`` record
    (:meth:`kvtrace.tracemodel.Trace.to_json`) without spans, plus
    ``t0_ns``, ``critical_ms`` (the handoff window in ms from t0) and
    ``decomposition`` (TTFT = queue+prefill, handoff, first decode step;
    seconds). Span rows carry offsets in ms from the trace start, ``point``,
    ``critical``, ``attributes`` (JSON), one ``attr_*`` column per key, the TP ``rank`` of a worker
    span (else None), ``lane`` (role · phase) and ``rank_lane`` (role rN · phase: one per rank)."""
    with store.reading(path) as c:
        tr = tracemodel.find(c, [trace_id]).get(trace_id)
    if tr is None:
        return None, pd.DataFrame()
    rec = tr.to_json()
    del rec["spans"]
    t0 = tr.t0_ns
    rows = []
    for s in tr.spans:
        a = dict(s.attributes)
        r = ranks.rank_of(s)
        row = {
            "phase": s.name,
            "role": s.role or "?",
            "rank": r,
            "lane": f"{s.role or '?'} · {s.name}",
            "rank_lane": f"{s.role or '?'}{f' r{r}' if r is not None else ''} · {s.name}",
            "start_ms": (s.start_ns - t0) / 1e6,
            "end_ms": (s.end_ns - t0) / 1e6,
            "duration_ms": (s.end_ns - s.start_ns) / 1e6,
            "point": s.point,
            "critical": s.critical,
            "outcome": s.outcome,
            "request_id": a.get(sc.ATTR_REQUEST_ID),
            "attributes": json.dumps(a, sort_keys=True, default=str),
        }
        for k, v in a.items():
            row[_attr_col(k)] = v if isinstance(v, (int, float, str, bool)) else str(v)
        rows.append(row)
    df = pd.DataFrame(rows)
    if len(df):
        df["role_rank"] = df["role"].map(lambda r: ROLE_ORDER.get(r, 9))
        df["phase_rank"] = df["phase"].map(phase_rank)
        df = df.sort_values(["role_rank", "start_ms", "phase_rank"]).reset_index(drop=True)
    rec["t0_ns"] = t0
    rec["critical_ms"] = tuple((t - t0) / 1e6 for t in tr.window) if tr.window else None
    rec["decomposition"] = tr.decomposition()
    return rec, df


def verdict_of(path: str | Path, since_ns: int | None) -> kv_verdict.Verdict:
    """:func:`kvtrace.verdict.from_store` on a short-lived read-only connection."""
    with store.reading(path) as c:
        return kv_verdict.from_store(c, since_ns=since_ns)


def whatif_of(path: str | Path, since_ns: int | None, from_mode: str) -> kv_whatif.WhatIf:
    """:func:`kvtrace.whatif.from_store` on a short-lived read-only connection."""
    with store.reading(path) as c:
        return kv_whatif.from_store(c, since_ns, from_mode)
