"""Pure data loaders for the dashboard: plain arguments in, pandas / plain
objects out, no Streamlit. ``dashboard/app.py`` wraps them in
``st.cache_data(ttl=...)`` and does all the drawing (STYLE.md: data apart
from drawing).

Sources
-------
* The trace store (:mod:`exporters.store`), always opened read-only, one
  short-lived connection per load (opening a SQLite file costs ~0.1 ms, and a
  store that appears or is replaced while the dashboard runs is just picked
  up). Every query is parameterised.
* Prometheus (``--prometheus URL``): PromQL over ``/api/v1/query`` with httpx;
  label values are escaped with :func:`escape_label_value`.

Errors are raised as :class:`StoreMissing`, :class:`StoreError` or
:class:`PrometheusError`; the pages turn them into a message, never a
traceback.
"""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence
from urllib.parse import urlencode

import pandas as pd

from exporters import store
from instrumented_connector import semconv as sc

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
#: PromQL range used when the picker says "all" (Prometheus keeps ~15 d).
PROM_ALL_RANGE = "7d"

#: Newest traces (in the window) loaded for live statistics; beyond this the
#: figures are over the newest ones only, and the page says so.
WINDOW_LIMIT = 200_000
#: Newest completed traces whose spans feed the per-phase breakdown.
PHASE_SAMPLE = 5_000

#: Phases that are not part of the handoff breakdown (they contain it).
_NOT_HANDOFF = (sc.Phase.REQUEST.value, sc.Phase.PREFILL.value)

#: Stacked-bar label for handoff time no phase accounts for (gaps, notif
#: latency). Not a Phase: it never leaves the dashboard.
UNATTRIBUTED = "unattributed"

CRITICAL = "critical path"
OVERLAP = "overlapped with prefill"


class StoreMissing(Exception):
    """The trace store file does not exist (yet)."""


class StoreError(Exception):
    """The store exists but cannot be read (not a kvlens store, corrupt, locked)."""


class PrometheusError(Exception):
    """Prometheus unreachable or the query failed."""


# ------------------------------------------------------------------ colours
# One fixed colour per Phase value (plus "unattributed"), so a phase has the
# same colour on every chart and in every trace.
_PALETTE = (
    "#4c78a8", "#9ecae9", "#f58518", "#ffbf79", "#54a24b", "#88d27a", "#b79a20",
    "#f2cf5b", "#439894", "#83bcb6", "#e45756", "#ff9d98", "#79706e", "#bab0ac",
    "#d67195", "#fcbfd2", "#b279a2", "#d6a5c9", "#9e765f", "#d8b5a5",
)


def phase_colors() -> tuple[list[str], list[str]]:
    """(domain, range) for altair's colour scale: every Phase in display order, then ``unattributed``."""
    domain = sorted(sc.PHASE_ORDER, key=sc.PHASE_ORDER.get) + [UNATTRIBUTED]
    rng = [_PALETTE[i % len(_PALETTE)] for i in range(len(domain) - 1)] + ["#c7c7c7"]
    return domain, rng


def phase_rank(name: str) -> int:
    return sc.PHASE_ORDER.get(name, len(sc.PHASE_ORDER))


def since_until(range_key: str, now_s: float | None = None) -> tuple[int | None, int | None]:
    """Wall-clock ns bounds for a picker choice (``None`` = unbounded)."""
    if range_key not in TIME_RANGES:
        raise ValueError(f"unknown time range {range_key!r} (choose from {list(TIME_RANGES)})")
    secs = TIME_RANGES[range_key]
    if secs is None:
        return None, None
    now_ns = int((time.time() if now_s is None else now_s) * 1e9)
    return now_ns - secs * 1_000_000_000, now_ns


def traces_link(*, page: str = "traces", **params: Any) -> str:
    """Relative link to the Traces page with its filters pre-set (query params)."""
    q = {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in params.items() if v is not None}
    return f"./?{urlencode({'page': page, **q})}"


# -------------------------------------------------------------------- store
@contextlib.contextmanager
def _open(path: str | Path) -> Iterator[sqlite3.Connection]:
    p = Path(path)
    if not p.exists():
        raise StoreMissing(str(p))
    try:
        conn = store.connect(p, readonly=True)
    except FileNotFoundError:
        raise StoreMissing(str(p)) from None
    except sqlite3.Error as e:
        raise StoreError(f"{p}: {e}") from e
    try:
        yield conn
    except sqlite3.Error as e:
        raise StoreError(f"{p}: {e}") from e
    finally:
        conn.close()


def store_info(path: str | Path) -> dict[str, Any]:
    """``{"traces": n, "spans": n, "first_ns", "last_ns", "bench_runs": n}``."""
    with _open(path) as c:
        r = c.execute("SELECT COUNT(*), MIN(start_ns), MAX(start_ns) FROM traces").fetchone()
        b = c.execute("SELECT COUNT(DISTINCT run_id) FROM bench_rows").fetchone()
        return {"traces": r[0], "first_ns": r[1], "last_ns": r[2], "bench_runs": b[0]}


_WINDOW_COLS = ["mode", "outcome", "start_ns", "ttft_s", "handoff_s"]


def window_traces(
    path: str | Path, since_ns: int | None, until_ns: int | None, limit: int = WINDOW_LIMIT
) -> pd.DataFrame:
    """Traces that started in [since_ns, until_ns], newest first (at most ``limit``)."""
    where, params = ["1=1"], []
    if since_ns is not None:
        where.append("start_ns >= ?")
        params.append(since_ns)
    if until_ns is not None:
        where.append("start_ns <= ?")
        params.append(until_ns)
    sql = (f"SELECT {', '.join(_WINDOW_COLS)} FROM traces WHERE {' AND '.join(where)} "
           "ORDER BY start_ns DESC LIMIT ?")
    with _open(path) as c:
        cur = c.cursor()
        cur.row_factory = None  # plain tuples: ~3x faster into pandas than sqlite3.Row
        rows = cur.execute(sql, [*params, int(limit)]).fetchall()
    return pd.DataFrame.from_records(rows, columns=_WINDOW_COLS)


@dataclass
class ModeStats:
    """Live figures for one mode (store- or Prometheus-derived). Seconds; None = n/a."""

    mode: str
    requests: float | None = None
    req_per_s: float | None = None
    handoff: dict[str, float | None] = field(default_factory=dict)  # p50 / p90 / p99
    ttft: dict[str, float | None] = field(default_factory=dict)  # mean / p50 / p99
    tpot_mean: float | None = None
    outcomes: dict[str, float] = field(default_factory=dict)
    dropped: float | None = None


def _q(s: pd.Series, q: float) -> float | None:
    s = s.dropna()
    return float(s.quantile(q)) if len(s) else None


def stats_from_traces(df: pd.DataFrame, window_s: float | None) -> dict[str, ModeStats]:
    """Per-mode figures from :func:`window_traces` rows. ``window_s`` None:
    the rate is over the span of the data itself."""
    out: dict[str, ModeStats] = {}
    for mode in MODES:
        d = df[df["mode"] == mode] if len(df) else df
        st = ModeStats(mode=mode, requests=float(len(d)))
        if len(d):
            span_s = window_s
            if span_s is None:
                span_s = max((d["start_ns"].max() - d["start_ns"].min()) / 1e9, 1.0)
            st.req_per_s = len(d) / span_s
        h = d["handoff_s"] if len(d) else pd.Series(dtype=float)
        t = d["ttft_s"] if len(d) else pd.Series(dtype=float)
        st.handoff = {"p50": _q(h, 0.5), "p90": _q(h, 0.9), "p99": _q(h, 0.99)}
        tt = t.dropna()
        st.ttft = {"mean": float(tt.mean()) if len(tt) else None, "p50": _q(t, 0.5), "p99": _q(t, 0.99)}
        counts = d["outcome"].value_counts().to_dict() if len(d) else {}
        st.outcomes = {o: float(counts.get(o, 0)) for o in OUTCOMES}
        out[mode] = st
    return out


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

    The split is measured per span, not assumed: in overlapped push the
    registration.* phases and most of ``match`` land before prefill.finished.
    ``unattributed`` is the mean handoff no critical-path phase accounts for.
    """
    where, params = ["handoff_s IS NOT NULL"], []
    if since_ns is not None:
        where.append("start_ns >= ?")
        params.append(since_ns)
    if until_ns is not None:
        where.append("start_ns <= ?")
        params.append(until_ns)
    sql = f"""
        WITH t AS (
            SELECT trace_id, mode, prefill_finished_ns AS pf, kv_ready_ns AS kv, handoff_s
            FROM traces WHERE {' AND '.join(where)} ORDER BY start_ns DESC LIMIT ?
        )
        SELECT t.mode AS mode, s.role AS role, s.name AS phase,
               SUM(MAX(0, MIN(s.end_ns, t.kv) - MAX(s.start_ns, t.pf))) / 1e9 AS crit,
               SUM(s.end_ns - s.start_ns) / 1e9 AS total
        FROM t JOIN spans s ON s.trace_id = t.trace_id
        WHERE s.name NOT IN ({','.join('?' * len(_NOT_HANDOFF))})
        GROUP BY t.mode, s.role, s.name
    """
    with _open(path) as c:
        rows = c.execute(sql, [*params, int(sample), *_NOT_HANDOFF]).fetchall()
        n = c.execute(
            f"SELECT mode, COUNT(*), AVG(handoff_s) FROM (SELECT mode, handoff_s FROM traces "
            f"WHERE {' AND '.join(where)} ORDER BY start_ns DESC LIMIT ?) GROUP BY mode",
            [*params, int(sample)],
        ).fetchall()
    per_mode = {r[0]: (r[1], r[2]) for r in n}
    out = []
    for mode, role, phase, crit, total in rows:
        cnt = per_mode.get(mode, (0, None))[0]
        if not cnt:
            continue
        crit_m, over_m = crit / cnt, max(total - crit, 0.0) / cnt
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
    return df


_SLOW_COLS = ["trace_id", "request_id", "mode", "dispatch", "outcome", "start_ns", "ttft_s", "handoff_s", "n_spans"]


def slowest(
    path: str | Path,
    n: int = 50,
    *,
    mode: str | None = None,
    outcome: str | None = None,
    since_ns: int | None = None,
    until_ns: int | None = None,
    min_handoff_s: float | None = None,
    max_handoff_s: float | None = None,
    order: str = "handoff",
) -> pd.DataFrame:
    """The store's ``slowest`` as a DataFrame (columns ``_SLOW_COLS``)."""
    with _open(path) as c:
        rows = store.slowest(
            c, n, mode=mode or None, outcome=outcome or None, since_ns=since_ns, until_ns=until_ns,
            min_handoff_s=min_handoff_s, max_handoff_s=max_handoff_s, order=order,
        )
    return pd.DataFrame([{k: r.get(k) for k in _SLOW_COLS} for r in rows], columns=_SLOW_COLS)


def _attr_col(key: str) -> str:
    """Attribute key -> a DataFrame/altair-safe column name (no dots)."""
    k = key[len("kvlens."):] if key.startswith("kvlens.") else key
    return "attr_" + k.replace(".", "_")


def trace_detail(path: str | Path, trace_id: str) -> tuple[dict[str, Any] | None, pd.DataFrame]:
    """(summary, spans) for one trace. ``summary`` is ``store.trace_record``
    without spans plus ``decomposition`` (TTFT = queue+prefill, handoff,
    first decode step; seconds). Span rows carry offsets in ms from the
    trace start, ``point``, ``critical`` (inside prefill.finished ->
    kv.ready), ``attributes`` (JSON text) and one ``attr_*`` column per key."""
    with _open(path) as c:
        summ = store.slowest(c, 1, trace_ids=[trace_id])
        spans = store.spans_for(c, [trace_id]).get(trace_id, [])
    if not summ:
        return None, pd.DataFrame()
    rec = store.trace_record(summ[0], spans)
    spans = rec.pop("spans")
    t0 = min([s["start_ns"] for s in spans] + [summ[0]["start_ns"] or 0]) if spans else summ[0]["start_ns"] or 0
    pf, kv = summ[0]["prefill_finished_ns"], summ[0]["kv_ready_ns"]
    rows = []
    for s in spans:
        a = s["attributes"] or {}
        start, end = s["start_ns"], s["end_ns"]
        point = start == end or s["name"] in {p.value for p in sc.POINT_PHASES}
        if pf is None or kv is None or s["name"] == sc.Phase.REQUEST.value:
            critical = False  # the root span contains everything: not a phase of the handoff
        else:
            if point:
                critical = pf <= start <= kv
            else:
                critical = min(end, kv) - max(start, pf) > 0
        row = {
            "phase": s["name"],
            "role": s["role"] or "?",
            "lane": f"{s['role'] or '?'} · {s['name']}",
            "start_ms": (start - t0) / 1e6,
            "end_ms": (end - t0) / 1e6,
            "duration_ms": (end - start) / 1e6,
            "point": bool(point),
            "critical": bool(critical),
            "outcome": s["outcome"],
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
    rec["critical_ms"] = ((pf - t0) / 1e6, (kv - t0) / 1e6) if pf is not None and kv is not None else None
    dec: dict[str, float | None] = {"queue_prefill_s": None, "handoff_s": rec["handoff_s"], "first_decode_s": None}
    req = [s for s in spans if s["name"] == sc.Phase.REQUEST.value]
    if req and pf is not None:
        dec["queue_prefill_s"] = (pf - req[0]["start_ns"]) / 1e9
        if kv is not None and rec["ttft_s"] is not None:
            dec["first_decode_s"] = rec["ttft_s"] - (kv - req[0]["start_ns"]) / 1e9  # ns ints: no float cancellation
    rec["decomposition"] = dec
    return rec, df


# -------------------------------------------------------------------- bench
def bench_runs(path: str | Path) -> list[dict[str, Any]]:
    with _open(path) as c:
        return store.bench_runs(c)


_BENCH_COLS = ["mode", "dispatch", "input_len", "output_len", "qps", "num_prompts", "completed", "failed",
               "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "handoff_p50_s", "handoff_p99_s",
               "req_per_s"]
_RATIO_OF = ["ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "handoff_p50_s", "handoff_p99_s"]


def bench_table(path: str | Path, run_id: str | None = None) -> pd.DataFrame:
    """One bench run's rows (latest by default), columns ``_BENCH_COLS``."""
    with _open(path) as c:
        rows = store.bench_rows(c, run_id)
    df = pd.DataFrame([{k: r.get(k) for k in _BENCH_COLS} for r in rows], columns=_BENCH_COLS)
    for k in _BENCH_COLS[4:]:
        df[k] = pd.to_numeric(df[k], errors="coerce")
    return df


def with_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Add ``<metric> push÷pull`` columns on push rows: the push figure over the
    pull figure of the same (input_len, output_len, qps) cell. <1: push wins."""
    out = df.copy()
    key = ["input_len", "output_len", "qps"]
    pull = out[out["mode"] == sc.Mode.PULL.value].drop_duplicates(subset=key).set_index(key)
    for m in _RATIO_OF:
        col = f"{m.removesuffix('_s')} push÷pull"
        vals = []
        for _, r in out.iterrows():
            v = None
            if r["mode"] == sc.Mode.PUSH.value:
                k = tuple(r[c] for c in key)
                if k in pull.index:
                    den = pull.loc[k, m]
                    if pd.notna(den) and den and pd.notna(r[m]):
                        v = float(r[m]) / float(den)
            vals.append(v)
        out[col] = pd.to_numeric(pd.Series(vals, index=out.index, dtype="object"), errors="coerce")
    return out


def live_compare(stats: Mapping[str, ModeStats]) -> pd.DataFrame:
    """Live-window push vs pull table (one row per mode, ratio row last)."""
    rows = []
    for mode in MODES:
        s = stats.get(mode)
        if s is None:
            continue
        rows.append({
            "mode": mode, "requests": s.requests, "req/s": s.req_per_s,
            "ttft_mean_s": s.ttft.get("mean"), "ttft_p50_s": s.ttft.get("p50"), "ttft_p99_s": s.ttft.get("p99"),
            "tpot_mean_s": s.tpot_mean,
            "handoff_p50_s": s.handoff.get("p50"), "handoff_p90_s": s.handoff.get("p90"),
            "handoff_p99_s": s.handoff.get("p99"),
        })
    df = pd.DataFrame(rows)
    if len(df) == 2:
        num = df.columns.drop("mode")
        a = pd.to_numeric(df.iloc[0][num], errors="coerce").astype(float)
        b = pd.to_numeric(df.iloc[1][num], errors="coerce").astype(float)
        ratio = (a / b.where(b != 0)).where(a.notna() & b.notna())
        df.loc[len(df)] = {"mode": "push÷pull", **ratio.to_dict()}
    return df


# --------------------------------------------------------------- Prometheus
def escape_label_value(value: str) -> str:
    """Escape a PromQL label value for a double-quoted string literal."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def selector(metric: str, **labels: str) -> str:
    """``metric{k="v",...}`` with escaped values (label names are ours, fixed)."""
    if not labels:
        return metric
    inner = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
    return f"{metric}{{{inner}}}"


def prom_range(range_key: str) -> str:
    secs = TIME_RANGES[range_key]
    return PROM_ALL_RANGE if secs is None else range_key


def prom_query(url: str, query: str, *, client=None, timeout_s: float = 3.0) -> list[tuple[dict[str, str], float]]:
    """Instant query -> [(labels, value)]; NaN/Inf samples dropped."""
    import httpx

    own = client is None
    c = client or httpx.Client(timeout=timeout_s)
    try:
        r = c.get(url.rstrip("/") + "/api/v1/query", params={"query": query})
        body = r.json()
    except (httpx.HTTPError, ValueError) as e:
        raise PrometheusError(f"{url}: {type(e).__name__}: {e}") from e
    finally:
        if own:
            c.close()
    if r.status_code != 200 or body.get("status") != "success":
        raise PrometheusError(f"{url}: {body.get('errorType', r.status_code)}: {body.get('error', '')} [{query}]")
    out = []
    data = body.get("data") or {}
    results = data.get("result") or []
    if data.get("resultType") == "scalar":
        results = [{"metric": {}, "value": results}]
    for item in results:
        try:
            v = float(item["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if math.isfinite(v):
            out.append((item.get("metric") or {}, v))
    return out


def _one(res: Sequence[tuple[dict, float]]) -> float | None:
    return res[0][1] if res else None


def prom_overview(url: str, range_key: str, *, timeout_s: float = 3.0) -> tuple[dict[str, ModeStats], pd.DataFrame, pd.DataFrame]:
    """(stats per mode, phase breakdown, handoff histogram) from Prometheus.

    Phase split: Prometheus has per-phase durations, not their position
    against prefill.finished, so push's registration.* phases are counted as
    overlap (PUSH_OVERLAP_PHASES) and every other phase as critical path.
    """
    import httpx

    w = prom_range(range_key)
    stats: dict[str, ModeStats] = {}
    phases, hist = [], []
    overlap = {p.value for p in sc.PUSH_OVERLAP_PHASES}
    points = {p.value for p in sc.POINT_PHASES}
    with httpx.Client(timeout=timeout_s) as c:
        def q(expr: str):
            return prom_query(url, expr, client=c)

        # labelled by role only (not mode): the same all-process total shows in both columns
        dropped = _one(q(f"sum(increase(kvlens_telemetry_dropped_total[{w}]))"))
        for mode in MODES:
            st = ModeStats(mode=mode)
            hb = selector("kvlens_handoff_seconds_bucket", mode=mode)
            # handoff pXX = histogram_quantile(q, sum by (le) (rate(kvlens_handoff_seconds_bucket{mode=m}[w])))
            for name, qq in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
                st.handoff[name] = _one(q(f"histogram_quantile({qq}, sum by (le) (rate({hb}[{w}])))"))
            tb = selector("kvlens_ttft_seconds_bucket", mode=mode)
            for name, qq in (("p50", 0.5), ("p99", 0.99)):
                st.ttft[name] = _one(q(f"histogram_quantile({qq}, sum by (le) (rate({tb}[{w}])))"))
            st.ttft["mean"] = _one(q(
                f"sum(rate({selector('kvlens_ttft_seconds_sum', mode=mode)}[{w}])) / "
                f"sum(rate({selector('kvlens_ttft_seconds_count', mode=mode)}[{w}]))"))
            req = selector("kvlens_requests_total", mode=mode)
            st.req_per_s = _one(q(f"sum(rate({req}[{w}]))"))
            st.outcomes = {o: 0.0 for o in OUTCOMES}
            for labels, v in q(f"sum by (outcome) (increase({req}[{w}]))"):
                st.outcomes[labels.get("outcome", sc.OTHER)] = v
            st.requests = sum(st.outcomes.values())
            st.dropped = dropped
            stats[mode] = st
            # mean per phase = rate(_sum) / rate(_count), per (role, phase)
            ps = selector("kvlens_phase_duration_seconds_sum", mode=mode)
            pc = selector("kvlens_phase_duration_seconds_count", mode=mode)
            for labels, v in q(f"sum by (role, phase) (rate({ps}[{w}])) / sum by (role, phase) (rate({pc}[{w}]))"):
                ph = labels.get("phase", sc.OTHER)
                if ph in _NOT_HANDOFF or ph in points or v <= 0:
                    continue
                path = OVERLAP if mode == sc.Mode.PUSH.value and ph in overlap else CRITICAL
                phases.append((mode, labels.get("role", ""), ph, path, v, None))
            cum = sorted(
                ((float(labels["le"]), v) for labels, v in q(f"sum by (le) (increase({hb}[{w}]))")
                 if labels.get("le") not in (None, "+Inf")),
            )
            prev_le, prev_v = 0.0, 0.0
            for le, v in cum:
                if v - prev_v > 0:
                    hist.append((mode, prev_le, le, v - prev_v,
                                 traces_link(mode=mode, min_handoff=prev_le, max_handoff=le)))
                prev_le, prev_v = le, v
    ph_df = pd.DataFrame(phases, columns=["mode", "role", "phase", "path", "seconds", "requests"])
    if len(ph_df):
        ph_df["rank"] = ph_df["phase"].map(phase_rank)
        ph_df = ph_df.sort_values(["mode", "path", "rank"]).reset_index(drop=True)
    return stats, ph_df, pd.DataFrame(hist, columns=["mode", "lo", "hi", "count", "link"])
