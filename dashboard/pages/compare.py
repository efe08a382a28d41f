"""Compare page: push vs pull from the benchmark grid (``kvlens bench`` /
``kvlens demo`` rows in the store, with push÷pull ratios of each cell, their
95 % intervals and the verdict they allow) and over a live window of traced
requests.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import charts
from dashboard import benchdata
from dashboard import data
from dashboard import loaders
from dashboard import ui, verdictview
from kvtrace import benchrows

LABELS = {
    "input_len": "input len", "qps": "QPS",
    "ttft_mean_s": "TTFT mean (ms)", "ttft_p50_s": "TTFT p50 (ms)", "ttft_p99_s": "TTFT p99 (ms)",
    "tpot_mean_s": "TPOT mean (ms)", "handoff_p50_s": "handoff p50 (ms)", "handoff_p90_s": "handoff p90 (ms)",
    "handoff_p99_s": "handoff p99 (ms)",
}  # fmt: skip


def main() -> None:
    cfg = ui.parse_config()
    st.title("Compare: push vs pull")
    if ui.store_banner(cfg) is None:
        return
    st.header("Benchmark grid")
    if not bench_grid(cfg):
        return
    st.header("Live window")
    live_window(cfg)
    st.header("Predicted against measured (what-if)")
    verdictview.whatif_compare(cfg, st.session_state.get("cmp_range", "1h"))


def bench_grid(cfg: ui.Config) -> bool:
    """Pick a bench run; its table (ms, ratios), all its columns and the handoff-vs-QPS chart.
    False when the store could not be read (message shown)."""
    ok, runs = ui.guarded(cfg, lambda: loaders.load_bench_runs(cfg.store, loaders.now_bucket()))
    if not ok:
        return False
    if not runs:
        st.info("No benchmark results in the store yet. Run `kvlens bench` (or `kvlens demo`) to fill the grid.")
        return True
    labels = {r["run_id"]: f"{r['run_id']} · {ui.fmt_ts(r['created_ns'])} · {r['rows']} rows" for r in runs}
    run_id = st.selectbox("Run", list(labels), format_func=labels.get, key="cmp_run")
    ok, df = ui.guarded(cfg, lambda: loaders.load_bench(cfg.store, run_id))
    if not ok:
        return True
    if not len(df):
        st.info("The selected run has no rows.")
        return True
    show = ms_text(bench_display(df))
    st.dataframe(
        ui.table_view(show, ms_formats(show)), hide_index=True, width="stretch", column_config=ms_columns(show)
    )
    st.caption(
        "Times in ms. Ratio columns: push ÷ pull for the same input length, output length and QPS "
        "(< 1: push is faster), on the push rows. 95% CI: the bootstrap interval of the p50 ratio over "
        "the cell's requests and rounds; a side is lower only where the interval excludes 1, otherwise "
        'the verdict is "no resolvable difference". -: no figure (see each column\'s ?).'
    )
    with st.expander("All columns of this run"):
        st.dataframe(ui.table_view(without_bare_ratios(df)), hide_index=True, width="stretch")
    st.altair_chart(charts.bench_chart(df))
    return True


def live_window(cfg: ui.Config) -> None:
    """Push and pull over the traced requests of a time range, then push
    against pull as ``kvlens verdict`` compares them: each ratio with its
    stratified 95 % interval and what it allows (no ratio without one)."""
    range_key = st.select_slider("Time range", options=list(data.TIME_RANGES), value="1h", key="cmp_range")
    now = loaders.now_bucket(range_key)
    ok, win = ui.guarded(cfg, lambda: loaders.load_window(cfg.store, range_key, now))
    if not ok:
        return
    if not len(win):
        st.info(f"No traced requests in the last {range_key}.")
        return
    live = benchdata.live_compare(data.stats_from_traces(win, data.TIME_RANGES[range_key]))
    show = live.rename(columns=LABELS)
    for c in show.columns:
        if c.endswith("(ms)"):
            show[c] = pd.to_numeric(show[c], errors="coerce") * 1e3
    fmts = {c: ",.0f" if c == "requests" else ".3g" if c == "req/s" else ".2f" for c in show.columns[1:]}
    st.dataframe(
        ui.table_view(ms_text(show), fmts),
        hide_index=True,
        width="stretch",
        column_config={
            "TPOT mean (ms)": st.column_config.TextColumn(
                "TPOT mean (ms)", help="-: the trace store records no per-request TPOT (see the grid above)"
            ),
            "req/s": st.column_config.TextColumn(
                "req/s", help="over the range, or over the age of the data in it where that is shorter"
            ),
        },
    )
    st.caption("-: no figure in this window.")
    since, _ = data.since_until(range_key, now)
    ok, v = ui.guarded(cfg, lambda: loaders.load_verdict(cfg.store, since))
    if not ok:
        return
    st.markdown(f"**Push against pull, last {range_key}** (the figures of `kvlens verdict --window {range_key}`)")
    if v.status != "ok":
        st.info(f"No comparison: {v.message}.")
        return
    st.dataframe(verdictview.verdict_rows(v), hide_index=True, width="stretch")
    st.caption(
        f"{v.selection_words()}, {v.message}. Ratios of push's percentile to pull's within prompt-length "
        "buckets, with a stratified bootstrap 95% interval; a side is lower only where the interval "
        "excludes 1 (docs/verdict.md)."
    )


#: The push÷pull ratio columns that carry an interval (the bench stores one for these only).
WITH_INTERVAL = tuple(loaders.ratio_column(m) for m in benchrows.STORED_RATIOS.values())


def without_bare_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` without the push÷pull columns that have no interval beside them."""
    return df.drop(columns=[c for c in df.columns if "÷" in c and c not in WITH_INTERVAL])


def bench_display(df: pd.DataFrame) -> pd.DataFrame:
    """The grid table: mode, input length, QPS, TTFT, TPOT, handoff (ms), then push÷pull ratios."""
    keep = [
        "mode",
        "dispatch",
        "input_len",
        "qps",
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_mean_s",
        "handoff_p50_s",
        "handoff_p99_s",
    ]
    out = df[keep].copy()
    for c in keep[4:]:
        out[c] = out[c] * 1e3
    out = out.rename(columns=LABELS)
    for c in WITH_INTERVAL:  # a ratio only with its interval (below)
        if c in df.columns:
            out[c] = df[c]
    out["rounds"] = df["rounds"] if "rounds" in df.columns else float("nan")
    for name, metric in (("TTFT p50", "ttft_p50_s"), ("handoff p50", "handoff_p50_s")):
        cis, verdicts = zip(*(interval_cells(r, metric) for r in df.to_dict("records"))) if len(df) else ((), ())
        out[f"{name} 95% CI"] = list(cis)
        out[f"{name} verdict"] = list(verdicts)
    return out


def _nan(v: Any) -> bool:
    return v is None or (isinstance(v, float) and v != v)


def interval_cells(row: dict, metric: str) -> tuple[str | None, str | None]:
    """(the interval as text, the verdict) of a bench row's push÷pull ratio of
    ``metric``; (None, None) where there is no ratio (pull rows, a cell
    without pull, a missing figure), and no verdict for rows saved before
    intervals were recorded."""
    if row.get("mode") != "push" or _nan(row.get(f"{metric.removesuffix('_s')} push÷pull")):
        return None, None
    if _nan(row.get("rounds")):
        return None, "no interval recorded"
    lo, hi = (row.get(k) for k in benchrows.interval_keys(metric))
    ci = None if _nan(lo) or _nan(hi) else f"{lo:.2f}–{hi:.2f}"
    return ci, benchrows.verdict(None if _nan(lo) else lo, None if _nan(hi) else hi)


def ms_text(df: pd.DataFrame) -> pd.DataFrame:
    """A copy with every ``(ms)`` column as text to the digits a time carries
    without a bound (:func:`dashboard.ui.fmt_ms`: 3 significant digits, whole
    ms at least: ``12.3``, ``9,247``); ``-`` where missing."""
    out = df.copy()
    for c in out.columns:
        if c.endswith("(ms)"):
            out[c] = [ui.fmt_ms(None if _nan(v) else float(v) / 1e3) for v in out[c]]
    return out


def ms_formats(df: pd.DataFrame) -> dict[str, str]:
    """Cell formats of the grid (its ms columns are text already, :func:`ms_text`):
    ratios as ``0.80×``, lengths as integers."""
    fmts = {"input_len": ",.0f", "rounds": ",.0f"}
    for c in df.columns:
        if "÷" in c:
            fmts[c] = "{:.2f}×"
    return fmts


def ms_columns(df: pd.DataFrame) -> dict[str, Any]:
    """The grid's column help: what ``-`` means there."""
    cfg: dict[str, Any] = {}
    for c in df.columns:
        if "÷" in c:
            cfg[c] = st.column_config.TextColumn(
                c, help="push ÷ pull of the same cell, on the push row; -: on pull rows, or a side has no figure"
            )
        elif c.startswith("TPOT"):
            cfg[c] = st.column_config.TextColumn(c, help="-: unknown (every token of the cell arrived together)")
        elif c.endswith("95% CI"):
            cfg[c] = st.column_config.TextColumn(
                c,
                help="95% bootstrap interval of the push ÷ pull p50 ratio, over "
                "the cell's rounds and requests; -: pull rows, or not enough data",
            )
        elif c.endswith("verdict"):
            cfg[c] = st.column_config.TextColumn(
                c,
                help="push/pull lower: the interval excludes 1; no resolvable "
                "difference: it contains 1; not enough data: under 2 requests a side",
            )
        elif c == "rounds":
            cfg[c] = st.column_config.TextColumn(
                c, help="rounds pooled (kvlens bench --repeat); -: a run saved before intervals were recorded"
            )
    return cfg


if __name__ == "__main__":
    ui.run_page(main, "compare")
