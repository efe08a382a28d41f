"""kvlens dashboard (Streamlit): push vs pull KV handoff, live and from the
benchmark grid, and per-request P+D waterfalls.

Run it with ``kvlens dashboard [--store PATH] [--prometheus URL]``, or
directly: ``streamlit run dashboard/app.py -- --store PATH``.

Pages are short functions; every load goes through a ``st.cache_data``
wrapper around a pure loader in :mod:`dashboard.data`. Nothing runs at import.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

try:  # `streamlit run dashboard/app.py` from a checkout: the repo root is not on sys.path
    import dashboard.data  # noqa: F401
except ModuleNotFoundError:  # pragma: no cover - depends on how it is started
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import altair as alt
import pandas as pd
import streamlit as st

from dashboard import data as D
from instrumented_connector import semconv as sc

REFRESH_CHOICES = {"2s": 2, "5s": 5, "10s": 10, "30s": 30}
CACHE_TTL_S = 5
_MODE_TITLE = {"push": "Push (NixlPushConnector)", "pull": "Pull (NixlConnector)"}


@dataclass(frozen=True)
class Config:
    store: str
    prometheus: str | None


def parse_config(argv: list[str] | None = None) -> Config:
    """Script arguments (after ``--`` on the streamlit command line)."""
    p = argparse.ArgumentParser(prog="kvlens-dashboard", add_help=False, allow_abbrev=False)
    p.add_argument("--store", default=None)
    p.add_argument("--prometheus", default=None)
    args, _ = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.store:
        store = str(Path(args.store).expanduser().resolve())
    else:
        from kvlens.home import store_path

        store = str(store_path())
    return Config(store=store, prometheus=(args.prometheus or None))


# ------------------------------------------------------------------ cached loaders
def _now_bucket(range_key: str | None = None) -> int:
    """Current time rounded down to a step, so windowed loads share a cache
    entry. Wide ranges (a whole store can be 100k+ traces, ~1 s to load)
    refresh less often than the live ones."""
    secs = D.TIME_RANGES.get(range_key) if range_key else 0
    step = CACHE_TTL_S if secs is not None and secs <= 3600 else 30 if secs and secs <= 86400 else 60
    return int(time.time() // step) * step


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def load_info(path: str, _bucket: int) -> dict[str, Any]:
    return D.store_info(path)


@st.cache_data(ttl=60, max_entries=16, show_spinner=False)
def load_window(path: str, range_key: str, now_s: int) -> pd.DataFrame:
    since, until = D.since_until(range_key, now_s)
    return D.window_traces(path, since, until)


@st.cache_data(ttl=60, max_entries=16, show_spinner=False)
def load_phases(path: str, range_key: str, now_s: int) -> pd.DataFrame:
    since, until = D.since_until(range_key, now_s)
    return D.phase_breakdown(path, since, until)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def load_prometheus(url: str, range_key: str, _bucket: int):
    return D.prom_overview(url, range_key)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def load_slowest(path: str, n: int, mode: str | None, outcome: str | None, range_key: str, now_s: int,
                 min_h: float | None, max_h: float | None, order: str) -> pd.DataFrame:
    since, until = D.since_until(range_key, now_s)
    return D.slowest(path, n, mode=mode, outcome=outcome, since_ns=since, until_ns=until,
                     min_handoff_s=min_h, max_handoff_s=max_h, order=order)


@st.cache_data(ttl=60, show_spinner=False)
def load_trace(path: str, trace_id: str):
    return D.trace_detail(path, trace_id)


@st.cache_data(ttl=30, show_spinner=False)
def load_bench_runs(path: str, _bucket: int) -> list[dict[str, Any]]:
    return D.bench_runs(path)


@st.cache_data(ttl=30, show_spinner=False)
def load_bench(path: str, run_id: str | None) -> pd.DataFrame:
    return D.with_ratios(D.bench_table(path, run_id))


# ------------------------------------------------------------------ helpers
def guarded(cfg: Config, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """Run a store load; on a missing / unreadable store show a message instead."""
    try:
        return True, fn()
    except D.StoreMissing:
        st.warning(
            f"No trace store at `{cfg.store}` yet. It appears once an instrumented P/D pair "
            "(`kvlens up`, `kvlens demo`) has served a request; pick another file with "
            "`kvlens dashboard --store PATH`."
        )
    except D.StoreError as e:
        st.error(f"The trace store could not be read: {e}")
    return False, None


def fmt_s(v: float | None, unit: str = "s") -> str:
    if v is None or pd.isna(v):
        return "n/a"
    if unit == "s":
        return f"{v * 1e3:.1f} ms" if abs(v) < 1 else f"{v:.2f} s"
    return f"{v:.2f} {unit}"


def fmt_n(v: float | None, digits: int = 0) -> str:
    if v is None or pd.isna(v):
        return "n/a"
    return f"{v:,.{digits}f}"


def phase_color_scale() -> alt.Scale:
    domain, rng = D.phase_colors()
    return alt.Scale(domain=domain, range=rng)


def _ts(ns: int | None) -> str:
    return datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S") if ns else "n/a"


# ------------------------------------------------------------------ charts
def handoff_hist_chart(h: pd.DataFrame, mode: str, x_max: float | None) -> alt.Chart:
    d = h[h["mode"] == mode].assign(lo_ms=lambda x: x["lo"] * 1e3, hi_ms=lambda x: x["hi"] * 1e3)
    x_scale = alt.Scale(domain=[0, x_max * 1e3]) if x_max else alt.Undefined
    return (
        alt.Chart(d, title="handoff distribution (click a bar: its traces)")
        .mark_bar(color="#4c78a8" if mode == "push" else "#f58518", cursor="pointer", stroke="white",
                  strokeWidth=0.5)
        .encode(
            x=alt.X("lo_ms:Q", title="handoff (ms)", scale=x_scale),
            x2="hi_ms:Q",
            y=alt.Y("count:Q", title="requests"),
            y2=alt.datum(0),
            href="link:N",
            tooltip=[alt.Tooltip("lo_ms:Q", title="from ms", format=".2f"),
                     alt.Tooltip("hi_ms:Q", title="to ms", format=".2f"), alt.Tooltip("count:Q")],
        )
        .properties(height=230)
    )


def phase_chart(ph: pd.DataFrame, mode: str, path: str, x_max: float | None, title: str) -> alt.Chart:
    """One stacked bar: mean ms per request of each phase on ``path``."""
    d = ph[(ph["mode"] == mode) & (ph["path"] == path)].assign(ms=lambda x: x["seconds"] * 1e3, bar=mode)
    present = sorted(set(d["phase"]), key=D.phase_rank)
    x_scale = alt.Scale(domain=[0, x_max * 1e3]) if x_max else alt.Undefined
    return (
        alt.Chart(d, title=title)
        .mark_bar()
        .encode(
            y=alt.Y("bar:N", title=None, axis=None),
            x=alt.X("sum(ms):Q", title="ms per request (mean)", stack="zero", scale=x_scale),
            color=alt.Color("phase:N", scale=phase_color_scale(),
                            legend=alt.Legend(title=None, orient="bottom", columns=4, values=present)),
            order=alt.Order("rank:Q"),
            tooltip=["phase:N", "role:N", alt.Tooltip("ms:Q", title="ms / request", format=".3f"),
                     alt.Tooltip("requests:Q", title="over requests")],
        )
        # fit-x: the width follows the column, the height is the plot's own (legend below it)
        .properties(height=40, autosize=alt.AutoSizeParams(type="fit-x", contains="padding"))
    )


def waterfall_chart(spans: pd.DataFrame, critical_ms: tuple[float, float] | None) -> alt.LayerChart:
    lanes = list(dict.fromkeys(spans["lane"]))
    attr_cols = [c for c in spans.columns if c.startswith("attr_")]
    tooltip = ([alt.Tooltip("phase:N"), alt.Tooltip("role:N"),
                alt.Tooltip("start_ms:Q", title="start (ms)", format=".3f"),
                alt.Tooltip("duration_ms:Q", title="duration (ms)", format=".3f"),
                alt.Tooltip("critical:N", title="on critical path"), alt.Tooltip("outcome:N")]
               + [alt.Tooltip(f"{c}:N", title=c[5:]) for c in attr_cols])
    y = alt.Y("lane:N", sort=lanes, title=None, axis=alt.Axis(labelLimit=260))
    color = alt.Color("phase:N", scale=phase_color_scale(), legend=alt.Legend(title="phase"))
    layers = []
    if critical_ms is not None:
        band = pd.DataFrame([{"from_ms": critical_ms[0], "to_ms": critical_ms[1],
                              "label": f"critical path (handoff {critical_ms[1] - critical_ms[0]:.2f} ms)"}])
        layers.append(
            alt.Chart(band).mark_rect(color="#e45756", opacity=0.12)
            .encode(x="from_ms:Q", x2="to_ms:Q", tooltip=["label:N"])
        )
        layers.append(
            alt.Chart(band).mark_text(align="left", dx=3, dy=-6, color="#b22222", fontWeight="bold", baseline="bottom")
            .encode(x="from_ms:Q", y=alt.value(0), text="label:N")
        )
    bars = spans[~spans["point"]]
    points = spans[spans["point"]]
    layers.append(
        alt.Chart(bars).mark_bar(height=14, cornerRadius=2)
        .encode(
            x=alt.X("start_ms:Q", title="ms since the request reached the router"),
            x2="end_ms:Q", y=y, color=color,
            opacity=alt.condition("datum.critical", alt.value(1.0), alt.value(0.45)),
            stroke=alt.condition("datum.critical", alt.value("#b22222"), alt.value(None)),
            strokeWidth=alt.condition("datum.critical", alt.value(2), alt.value(0)),
            tooltip=tooltip,
        )
    )
    layers.append(
        alt.Chart(points).mark_point(shape="diamond", size=160, filled=True)
        .encode(
            x="start_ms:Q", y=y, color=color,
            stroke=alt.condition("datum.critical", alt.value("#b22222"), alt.value("#333333")),
            strokeWidth=alt.value(1.5),
            tooltip=tooltip,
        )
    )
    return alt.layer(*layers).properties(height=max(180, 30 * len(lanes) + 40))


# ------------------------------------------------------------------ pages
def store_banner(cfg: Config) -> dict[str, Any] | None:
    ok, info = guarded(cfg, lambda: load_info(cfg.store, _now_bucket()))
    if not ok:
        return None
    if not info["traces"] and not info["bench_runs"]:
        st.info(f"The trace store `{cfg.store}` is empty: no request has been traced yet.")
    return info


def overview_page(cfg: Config, pages: dict[str, Any]) -> None:
    st.title("Overview: push vs pull, live")
    c1, c2, c3 = st.columns([2, 1, 1])
    range_key = c1.select_slider("Time range", options=list(D.TIME_RANGES), value="1h", key="ov_range")
    live = c2.toggle("Auto-refresh", value=True, key="ov_live")
    every = c3.selectbox("Every", list(REFRESH_CHOICES), index=1, key="ov_every", disabled=not live)
    run_every = REFRESH_CHOICES[every] if live else None
    st.fragment(run_every=run_every)(lambda: overview_body(cfg, pages, range_key))()


def overview_body(cfg: Config, pages: dict[str, Any], range_key: str) -> None:
    stats = phases = hist = None
    source = None
    if cfg.prometheus:
        try:
            stats, phases, hist = load_prometheus(cfg.prometheus, range_key, _now_bucket())
            source = f"Prometheus at `{cfg.prometheus}` (rates over {D.prom_range(range_key)})"
            if not any((s.requests or 0) > 0 for s in stats.values()):
                st.info("Prometheus answered but has no kvlens samples in this range; showing the trace store.")
                stats = None
        except D.PrometheusError as e:
            st.warning(f"Prometheus is unreachable or refused the query ({e}); showing the trace store instead.")
            stats = None
    if stats is None:
        info = store_banner(cfg)
        if info is None:
            return
        now = _now_bucket(range_key)
        ok, df = guarded(cfg, lambda: load_window(cfg.store, range_key, now))
        if not ok:
            return
        if not len(df):
            if info["traces"]:
                st.info(f"No traces in the last {range_key} (the newest started {_ts(info['last_ns'])}). "
                        "Pick a wider time range.")
            return
        if len(df) >= D.WINDOW_LIMIT:
            st.caption(f"Figures over the newest {D.WINDOW_LIMIT:,} requests of the range.")
        stats = D.stats_from_traces(df, D.TIME_RANGES[range_key])
        ok, phases = guarded(cfg, lambda: load_phases(cfg.store, range_key, now))
        if not ok:
            return
        hist = D.handoff_histogram(df)
        source = f"trace store `{cfg.store}`"
    st.caption(f"Source: {source}. Updated {datetime.now().strftime('%H:%M:%S')}. "
               "Handoff = prefill.finished (P) → kv.ready (D).")

    crit = phases[phases["path"] == D.CRITICAL] if len(phases) else phases
    tot = crit.groupby("mode")["seconds"].sum() if len(crit) else pd.Series(dtype=float)
    ph_max = float(tot.max()) if len(tot) else None  # one x scale: push and pull bars compare
    h_max = float(hist["hi"].max()) if len(hist) else None
    cols = st.columns(2, gap="large")
    for col, mode in zip(cols, D.MODES):
        with col:
            mode_column(pages, mode, stats[mode], phases, hist, ph_max, h_max)


def mode_column(pages, mode: str, s: D.ModeStats, phases: pd.DataFrame, hist: pd.DataFrame,
                ph_max: float | None, h_max: float | None) -> None:
    with st.container(border=True, key=f"ov_{mode}"):
        st.subheader(_MODE_TITLE.get(mode, mode))
        if not s.requests:
            st.info(f"No {mode} requests in this range.")
            return
        a, b, c = st.columns(3)
        a.metric("handoff p50", fmt_s(s.handoff.get("p50")))
        b.metric("handoff p90", fmt_s(s.handoff.get("p90")))
        c.metric("handoff p99", fmt_s(s.handoff.get("p99")))
        a, b, c = st.columns(3)
        a.metric("TTFT p50 (client)", fmt_s(s.ttft.get("p50")))
        b.metric("TTFT p99 (client)", fmt_s(s.ttft.get("p99")))
        c.metric("TPOT mean", fmt_s(s.tpot_mean), help="Not recorded per request; see Compare for bench TPOT.")
        a, b, c = st.columns(3)
        a.metric("requests / s", f"{s.req_per_s:.3g}" if s.req_per_s is not None else "n/a")
        a.caption(f"{fmt_n(s.requests)} requests")
        bad = {k: v for k, v in s.outcomes.items() if k != sc.Outcome.OK.value}
        b.metric("ok", fmt_n(s.outcomes.get(sc.Outcome.OK.value)))
        b.caption(" · ".join(f"{k} {fmt_n(v)}" for k, v in bad.items()))
        c.metric("dropped telemetry", fmt_n(s.dropped) if s.dropped is not None else "n/a",
                 help="Spans dropped by kvlens in this range, all processes "
                      "(increase of kvlens_telemetry_dropped_total; needs --prometheus)")
        links = st.columns(3)
        for lc, (name, v) in zip(links, s.handoff.items()):
            if v is not None:
                lc.page_link(pages["traces"], label=f"≥ {name} traces", icon=":material/search:",
                             query_params={"mode": mode, "min_handoff": f"{v:.6g}"})
        if hist is not None and len(hist[hist["mode"] == mode]):
            st.altair_chart(handoff_hist_chart(hist, mode, h_max), width="stretch")
        mine = phases[phases["mode"] == mode] if phases is not None and len(phases) else pd.DataFrame()
        if not len(mine):
            st.caption("No completed handoffs with phase spans in this range.")
            return
        if (mine["path"] == D.CRITICAL).any():
            st.altair_chart(phase_chart(phases, mode, D.CRITICAL, ph_max,
                                        "critical path by phase (prefill.finished → kv.ready)"), width="stretch")
        if (mine["path"] == D.OVERLAP).any():
            st.altair_chart(phase_chart(phases, mode, D.OVERLAP, None,
                                        "overlapped with prefill (off the critical path)"), width="stretch")
        else:
            st.caption("Nothing overlaps prefill: every phase starts after prefill.finished.")


def compare_page(cfg: Config, pages: dict[str, Any]) -> None:
    st.title("Compare: push vs pull")
    if store_banner(cfg) is None:
        return
    st.header("Benchmark grid")
    ok, runs = guarded(cfg, lambda: load_bench_runs(cfg.store, _now_bucket()))
    if not ok:
        return
    if not runs:
        st.info("No benchmark results in the store yet. Run `kvlens bench` (or `kvlens demo`) to fill the grid.")
    else:
        labels = {r["run_id"]: f"{r['run_id']} · {_ts(r['created_ns'])} · {r['rows']} rows" for r in runs}
        run_id = st.selectbox("Run", list(labels), format_func=labels.get, key="cmp_run")
        ok, df = guarded(cfg, lambda: load_bench(cfg.store, run_id))
        if ok and len(df):
            st.dataframe(bench_display(df), hide_index=True, width="stretch",
                         column_config=ms_columns(bench_display(df)))
            st.caption("Times in ms. Ratio columns: push ÷ pull for the same input length, output length and QPS "
                       "(< 1: push is faster).")
            with st.expander("All columns of this run"):
                st.dataframe(df, hide_index=True, width="stretch")
            st.altair_chart(bench_chart(df))
        elif ok:
            st.info("The selected run has no rows.")

    st.header("Live window")
    range_key = st.select_slider("Time range", options=list(D.TIME_RANGES), value="1h", key="cmp_range")
    now = _now_bucket(range_key)
    ok, win = guarded(cfg, lambda: load_window(cfg.store, range_key, now))
    if not ok:
        return
    if not len(win):
        st.info(f"No traced requests in the last {range_key}.")
        return
    live = D.live_compare(D.stats_from_traces(win, D.TIME_RANGES[range_key]))
    show = live.rename(columns=_LABELS)
    for c in show.columns:
        if c.endswith("(ms)"):
            show[c] = pd.to_numeric(show[c], errors="coerce") * 1e3
    # the push÷pull row is a ratio, not ms: show it as such
    if len(show) == 3:
        for c in show.columns[1:]:
            if c.endswith("(ms)"):
                show.loc[2, c] = live.loc[2, [k for k, v in _LABELS.items() if v == c][0]]
    st.dataframe(show, hide_index=True, width="stretch",
                 column_config={c: st.column_config.NumberColumn(c, format="%.3f") for c in show.columns[1:]})
    st.caption("Last row: push ÷ pull (< 1: push is lower).")


_LABELS = {
    "input_len": "input len", "qps": "QPS",
    "ttft_mean_s": "TTFT mean (ms)", "ttft_p50_s": "TTFT p50 (ms)", "ttft_p99_s": "TTFT p99 (ms)",
    "tpot_mean_s": "TPOT mean (ms)", "handoff_p50_s": "handoff p50 (ms)", "handoff_p90_s": "handoff p90 (ms)",
    "handoff_p99_s": "handoff p99 (ms)",
}
_MODE_COLORS = alt.Scale(domain=["push", "pull"], range=["#4c78a8", "#f58518"])


def bench_display(df: pd.DataFrame) -> pd.DataFrame:
    """The grid table: mode, input length, QPS, TTFT, TPOT, handoff (ms), then push÷pull ratios."""
    keep = ["mode", "dispatch", "input_len", "qps", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s",
            "handoff_p50_s", "handoff_p99_s"]
    out = df[keep].copy()
    for c in keep[4:]:
        out[c] = out[c] * 1e3
    out = out.rename(columns=_LABELS)
    for c in df.columns:
        if "÷" in c:
            out[c] = df[c]
    return out


def ms_columns(df: pd.DataFrame) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    for c in df.columns:
        if c.endswith("(ms)"):
            cfg[c] = st.column_config.NumberColumn(c, format="%.2f")
        elif "÷" in c:
            cfg[c] = st.column_config.NumberColumn(c, format="%.2f×")
    return cfg


def bench_chart(df: pd.DataFrame) -> alt.Chart:
    long = df.melt(id_vars=["mode", "dispatch", "input_len", "qps"],
                   value_vars=["handoff_p50_s", "handoff_p99_s"], var_name="stat", value_name="s").dropna(subset=["s"])
    long["ms"] = long["s"] * 1e3
    long["dispatch"] = long["dispatch"].fillna("n/a")
    long["stat"] = long["stat"].str.replace("handoff_", "").str.replace("_s", "")
    long["series"] = long["mode"] + " " + long["dispatch"] + " " + long["stat"]
    return (
        alt.Chart(long, title="handoff vs QPS, per mode (solid p50, dashed p99)")
        .mark_line(point=True)
        .encode(
            x=alt.X("qps:Q", title="QPS"),
            y=alt.Y("ms:Q", title="handoff (ms)"),
            color=alt.Color("mode:N", scale=_MODE_COLORS, title="mode"),
            strokeDash=alt.StrokeDash("stat:N", title="percentile", sort=["p50", "p99"]),
            shape=alt.Shape("dispatch:N", title="dispatch"),
            detail="series:N",
            column=alt.Column("input_len:O", title="input length (tokens)"),
            tooltip=["mode:N", "dispatch:N", "stat:N", "input_len:O", "qps:Q", alt.Tooltip("ms:Q", format=".2f")],
        )
        .properties(width=360, height=260)
    )


_TR_KEYS = {"mode": "tr_mode", "outcome": "tr_outcome", "range": "tr_range", "min_handoff": "tr_min",
            "max_handoff": "tr_max", "n": "tr_n", "order": "tr_order", "trace": "tr_trace"}


def _float_or_none(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f else None


def apply_trace_query_params() -> None:
    """Pre-set the Traces filters from the URL (``?mode=push&min_handoff=0.12``),
    once per distinct set of params so later widget changes stick."""
    qp = {k: st.query_params.get(k) for k in _TR_KEYS if st.query_params.get(k) is not None}
    sig = tuple(sorted(qp.items()))
    if st.session_state.get("_tr_applied") == sig:
        return
    st.session_state["_tr_applied"] = sig
    if not qp:
        return
    ss = st.session_state
    ss["tr_mode"] = qp["mode"] if qp.get("mode") in D.MODES else "any"
    ss["tr_outcome"] = qp["outcome"] if qp.get("outcome") in D.OUTCOMES else "any"
    ss["tr_range"] = qp["range"] if qp.get("range") in D.TIME_RANGES else "all"
    ss["tr_min"] = _float_or_none(qp.get("min_handoff"))
    ss["tr_max"] = _float_or_none(qp.get("max_handoff"))
    if _float_or_none(qp.get("n")):
        ss["tr_n"] = int(min(max(_float_or_none(qp["n"]), 1), 500))
    if qp.get("order") in ("handoff", "ttft"):
        ss["tr_order"] = qp["order"]
    if qp.get("trace"):
        ss["_tr_want_trace"] = qp["trace"]


def traces_page(cfg: Config, pages: dict[str, Any]) -> None:
    st.title("Traces: slowest requests")
    apply_trace_query_params()
    if store_banner(cfg) is None:
        return
    # Defaults live in session state (not in the widgets' value=), so that
    # query params can pre-set any of them without Streamlit's double-default warning.
    for k, v in (("tr_mode", "any"), ("tr_outcome", "any"), ("tr_range", "all"), ("tr_min", None),
                 ("tr_max", None), ("tr_n", 50), ("tr_order", "handoff")):
        st.session_state.setdefault(k, v)
    f = st.columns([1, 1, 1, 1, 1, 1])
    mode = f[0].selectbox("Mode", ["any", *D.MODES], key="tr_mode")
    outcome = f[1].selectbox("Outcome", ["any", *D.OUTCOMES], key="tr_outcome")
    range_key = f[2].selectbox("Started in the last", list(D.TIME_RANGES), key="tr_range")
    min_h = f[3].number_input("Min handoff (s)", min_value=0.0, value=None, step=0.001, format="%.4f", key="tr_min")
    max_h = f[4].number_input("Max handoff (s)", min_value=0.0, value=None, step=0.001, format="%.4f", key="tr_max")
    n = int(f[5].number_input("Show N", min_value=1, max_value=500, step=10, key="tr_n"))
    order = st.radio("Order by", ["handoff", "ttft"], horizontal=True, key="tr_order")

    ok, df = guarded(cfg, lambda: load_slowest(
        cfg.store, n, None if mode == "any" else mode, None if outcome == "any" else outcome,
        range_key, _now_bucket(range_key), min_h, max_h, order))
    if not ok:
        return
    if not len(df):
        st.info("No traces match these filters.")
        return
    show = df.assign(
        started_utc=pd.to_datetime(df["start_ns"], unit="ns"),
        handoff_ms=df["handoff_s"] * 1e3, ttft_ms=df["ttft_s"] * 1e3,
    )[["trace_id", "mode", "dispatch", "outcome", "handoff_ms", "ttft_ms", "n_spans", "started_utc", "request_id"]]
    st.dataframe(show, hide_index=True, width="stretch", height=min(38 + 35 * len(show), 320),
                 column_config={"handoff_ms": st.column_config.NumberColumn("handoff (ms)", format="%.3f"),
                                "ttft_ms": st.column_config.NumberColumn("TTFT (ms)", format="%.3f")})

    ids = list(df["trace_id"])
    want = st.session_state.pop("_tr_want_trace", None)
    if want and want in ids:
        st.session_state["tr_trace"] = want
    if st.session_state.get("tr_trace") not in ids:
        st.session_state["tr_trace"] = ids[0]
    info = {r.trace_id: r for r in df.itertuples()}

    def label(tid: str) -> str:
        r = info[tid]
        h = fmt_s(r.handoff_s) if pd.notna(r.handoff_s) else "no handoff"
        return f"{tid[:12]}…  {r.mode}  {r.outcome}  handoff {h}"

    tid = st.selectbox("Trace", ids, format_func=label, key="tr_trace")
    # Keep the URL in step with the filters, so the view can be shared.
    st.query_params.from_dict({k: v for k, v in {
        "page": "traces", "mode": None if mode == "any" else mode, "outcome": None if outcome == "any" else outcome,
        "range": range_key, "min_handoff": None if min_h is None else f"{min_h:.6g}",
        "max_handoff": None if max_h is None else f"{max_h:.6g}", "trace": tid}.items() if v is not None})
    st.session_state["_tr_applied"] = tuple(sorted(
        (k, v) for k, v in st.query_params.to_dict().items() if k in _TR_KEYS))
    trace_view(cfg, tid)


def trace_view(cfg: Config, tid: str) -> None:
    ok, res = guarded(cfg, lambda: load_trace(cfg.store, tid))
    if not ok:
        return
    rec, spans = res
    if rec is None or not len(spans):
        st.info("This trace has no spans in the store.")
        return
    dec = rec["decomposition"]
    m = st.columns(6)
    m[0].metric("mode", rec["mode"] or "n/a")
    m[1].metric("outcome", rec["outcome"] or "n/a")
    m[2].metric("handoff", fmt_s(rec["handoff_s"]))
    m[3].metric("TTFT (client)", fmt_s(rec["ttft_s"]))
    m[4].metric("queue + prefill", fmt_s(dec["queue_prefill_s"]))
    m[5].metric("first decode step", fmt_s(dec["first_decode_s"]))
    st.caption(f"trace `{rec['trace_id']}` · request `{rec['request_id']}` · dispatch {rec.get('dispatch') or 'n/a'} · "
               "wall-clock timestamps; P↔D intervals assume synchronised host clocks. "
               "Red outline: on the critical path (prefill.finished → kv.ready); ◆ point phases.")
    st.altair_chart(waterfall_chart(spans, rec["critical_ms"]), width="stretch")
    st.dataframe(
        spans[["role", "phase", "start_ms", "duration_ms", "critical", "outcome", "attributes"]],
        hide_index=True, width="stretch",
        column_config={"start_ms": st.column_config.NumberColumn("start (ms)", format="%.3f"),
                       "duration_ms": st.column_config.NumberColumn("duration (ms)", format="%.3f")},
    )


# ------------------------------------------------------------------ entry point
def main() -> None:
    st.set_page_config(page_title="kvlens", page_icon=":material/swap_horiz:", layout="wide")
    cfg = parse_config()
    want = st.query_params.get("page")
    specs = {
        "overview": ("Overview", ":material/monitoring:", overview_page),
        "compare": ("Compare", ":material/compare_arrows:", compare_page),
        "traces": ("Traces", ":material/timeline:", traces_page),
    }
    default = want if want in specs else "overview"
    pages: dict[str, Any] = {}

    def make(key: str, fn: Callable[[Config, dict[str, Any]], None]) -> Callable[[], None]:
        def run() -> None:
            fn(cfg, pages)

        run.__name__ = f"{key}_page"
        return run

    for key, (title, icon, fn) in specs.items():
        pages[key] = st.Page(make(key, fn), title=title, icon=icon, url_path=key, default=(key == default))
    nav = st.navigation(list(pages.values()), position="top")
    if want in pages and nav is not pages[want]:
        st.switch_page(pages[want], query_params={k: v for k, v in st.query_params.to_dict().items() if k != "page"})
    with st.sidebar:
        st.markdown("**kvlens** · KV handoff, push vs pull")
        st.caption(f"store: `{cfg.store}`")
        st.caption(f"prometheus: `{cfg.prometheus or 'not set'}`")
    nav.run()


if __name__ == "__main__":
    main()
