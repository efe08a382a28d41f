"""Compare page: push vs pull from the benchmark grid (``kvlens bench`` /
``kvlens demo`` rows in the store, with push÷pull ratios of each cell) and
over a live window of traced requests.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import charts
from dashboard import data as D
from dashboard import loaders as L
from dashboard import ui

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


def bench_grid(cfg: ui.Config) -> bool:
    """Pick a bench run; its table (ms, ratios), all its columns and the handoff-vs-QPS chart.
    False when the store could not be read (message shown)."""
    ok, runs = ui.guarded(cfg, lambda: L.load_bench_runs(cfg.store, L.now_bucket()))
    if not ok:
        return False
    if not runs:
        st.info("No benchmark results in the store yet. Run `kvlens bench` (or `kvlens demo`) to fill the grid.")
        return True
    labels = {r["run_id"]: f"{r['run_id']} · {ui.fmt_ts(r['created_ns'])} · {r['rows']} rows" for r in runs}
    run_id = st.selectbox("Run", list(labels), format_func=labels.get, key="cmp_run")
    ok, df = ui.guarded(cfg, lambda: L.load_bench(cfg.store, run_id))
    if not ok:
        return True
    if not len(df):
        st.info("The selected run has no rows.")
        return True
    show = bench_display(df)
    st.dataframe(ui.table_view(show, ms_formats(show)), hide_index=True, width="stretch",
                 column_config=ms_columns(show))
    st.caption("Times in ms. Ratio columns: push ÷ pull for the same input length, output length and QPS "
               "(< 1: push is faster), on the push rows. -: no figure (see each column's ?).")
    with st.expander("All columns of this run"):
        st.dataframe(ui.table_view(df), hide_index=True, width="stretch")
    st.altair_chart(charts.bench_chart(df))
    return True


def live_window(cfg: ui.Config) -> None:
    """Push vs pull over the traced requests of a time range, with a push÷pull row."""
    range_key = st.select_slider("Time range", options=list(D.TIME_RANGES), value="1h", key="cmp_range")
    now = L.now_bucket(range_key)
    ok, win = ui.guarded(cfg, lambda: L.load_window(cfg.store, range_key, now))
    if not ok:
        return
    if not len(win):
        st.info(f"No traced requests in the last {range_key}.")
        return
    live = D.live_compare(D.stats_from_traces(win, D.TIME_RANGES[range_key]))
    show = live.rename(columns=LABELS)
    for c in show.columns:
        if c.endswith("(ms)"):
            show[c] = pd.to_numeric(show[c], errors="coerce") * 1e3
    # the push÷pull row is a ratio, not ms: show it as such
    if len(show) == 3:
        for c in show.columns[1:]:
            if c.endswith("(ms)"):
                show.loc[2, c] = live.loc[2, [k for k, v in LABELS.items() if v == c][0]]
    fmts = {c: ",.0f" if c == "requests" else ".3g" if c == "req/s" else ".2f" for c in show.columns[1:]}
    if len(show) == 3:  # the ratio row: two decimals, whatever the column
        show = ui.table_view(show.iloc[:2], fmts).pipe(
            lambda t: pd.concat([t, ui.table_view(show.iloc[2:], {c: ".2f" for c in show.columns[1:]})]))
    else:
        show = ui.table_view(show, fmts)
    st.dataframe(show, hide_index=True, width="stretch",
                 column_config={"TPOT mean (ms)": st.column_config.TextColumn(
                     "TPOT mean (ms)", help="-: the trace store records no per-request TPOT (see the grid above)")})
    st.caption("Last row: push ÷ pull (< 1: push is lower). -: no figure in this window.")


def bench_display(df: pd.DataFrame) -> pd.DataFrame:
    """The grid table: mode, input length, QPS, TTFT, TPOT, handoff (ms), then push÷pull ratios."""
    keep = ["mode", "dispatch", "input_len", "qps", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s",
            "handoff_p50_s", "handoff_p99_s"]
    out = df[keep].copy()
    for c in keep[4:]:
        out[c] = out[c] * 1e3
    out = out.rename(columns=LABELS)
    for c in df.columns:
        if "÷" in c:
            out[c] = df[c]
    return out


def ms_formats(df: pd.DataFrame) -> dict[str, str]:
    """Cell formats of the grid: ms to 2 decimals, ratios as ``0.80×``, lengths as integers."""
    fmts = {"input_len": ",.0f"}
    for c in df.columns:
        if c.endswith("(ms)"):
            fmts[c] = ".2f"
        elif "÷" in c:
            fmts[c] = "{:.2f}×"
    return fmts


def ms_columns(df: pd.DataFrame) -> dict[str, Any]:
    """The grid's column help: what ``-`` means there."""
    cfg: dict[str, Any] = {}
    for c in df.columns:
        if "÷" in c:
            cfg[c] = st.column_config.TextColumn(c, help="push ÷ pull of the same cell, on the push row; "
                                                 "-: on pull rows, or a side has no figure")
        elif c.startswith("TPOT"):
            cfg[c] = st.column_config.TextColumn(c, help="-: unknown (every token of the cell arrived together)")
    return cfg


if __name__ == "__main__":
    ui.run_page(main, "compare")
