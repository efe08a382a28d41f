"""Overview page: push vs pull side by side, live — handoff and TTFT
percentiles, request rate and outcomes, the handoff distribution (a bar links
to its traces) and where the handoff time goes, per phase. At the top, the
handoff health strip (open now, oldest open, stale, expired, failed,
registration timeouts) and the requests stuck now, each linking to its
partial trace.

Figures come from Prometheus when ``--prometheus`` is given and it has kvlens
samples in the range, else from the trace store. The body is a fragment that
reruns on its own every few seconds while auto-refresh is on.
"""

from __future__ import annotations

from datetime import datetime

import pandas as pd
import streamlit as st

from dashboard import charts
from dashboard import benchdata
from dashboard import data
from dashboard import loaders
from dashboard import cpushare, handoffhealthview, pairs, prom, ui, verdictview
from kvrecord import semconv as sc

REFRESH_CHOICES = {"2s": 2, "5s": 5, "10s": 10, "30s": 30}
MODE_TITLE = {"push": "Push (NixlPushConnector)", "pull": "Pull (NixlConnector)"}
TRACES_PAGE = "pages/traces.py"


def main() -> None:
    cfg = ui.parse_config()
    # The live verdict is the page's first line, drawn last: its bootstrap over
    # a large store takes seconds, and the page must not wait for it.
    top = st.container()
    st.title("Overview: push vs pull, live")
    c1, c2, c3 = st.columns([2, 1, 1])
    range_key = c1.select_slider("Time range", options=list(data.TIME_RANGES), value="1h", key="ov_range")
    live = c2.toggle("Auto-refresh", value=True, key="ov_live")
    every = c3.selectbox("Every", list(REFRESH_CHOICES), index=1, key="ov_every", disabled=not live)
    run_every = REFRESH_CHOICES[every] if live else None
    st.fragment(run_every=run_every)(lambda: body(cfg, range_key))()
    with top:
        verdictview.headline(cfg)


def from_prometheus(cfg: ui.Config, range_key: str) -> tuple | None:
    """(stats, phases, hist, source) from Prometheus, the handoff and TTFT
    percentiles exact from the trace store where it holds the requests
    (:func:`dashboard.data.exact_from_store`); None (after a message) when
    Prometheus is not set, fails or has no kvlens samples in the range."""
    if not cfg.prometheus:
        return None
    try:
        stats, phases, hist = loaders.load_prometheus(cfg.prometheus, range_key, loaders.now_bucket())
    except prom.PrometheusError as e:
        st.warning(f"Prometheus is unreachable or refused the query ({e}); showing the trace store instead.")
        return None
    if not any((s.requests or 0) > 0 for s in stats.values()):
        st.info("Prometheus answered but has no kvlens samples in this range; showing the trace store.")
        return None
    try:
        df = loaders.load_window(cfg.store, range_key, loaders.now_bucket(range_key))
        data.exact_from_store(stats, data.stats_from_traces(df, data.TIME_RANGES[range_key]), df=df)
    except (data.StoreMissing, data.StoreError) as e:
        data.exact_from_store(stats, None, why=f"the trace store could not be read: {e}")
    return stats, phases, hist, f"Prometheus at `{cfg.prometheus}` (counts over {prom.prom_range(range_key)})"


def from_store(cfg: ui.Config, range_key: str) -> tuple | str:
    """(stats, phases, hist, source) from the trace store; else why there are
    no figures (a message about the store is shown as well)."""
    info = ui.store_banner(cfg)
    if info is None:
        return f"the trace store `{cfg.store}` could not be read (see above)"
    now = loaders.now_bucket(range_key)
    ok, df = ui.guarded(cfg, lambda: loaders.load_window(cfg.store, range_key, now))
    if not ok:
        return f"the trace store `{cfg.store}` could not be read (see above)"
    if not len(df):
        if info["traces"]:
            return (
                f"no traces started in the last {range_key} (the newest started {ui.fmt_ts(info['last_ns'])}); "
                "pick a wider time range"
            )
        return "no request has been traced yet"
    if len(df) >= data.WINDOW_LIMIT:
        st.caption(f"Figures over the newest {data.WINDOW_LIMIT:,} requests of the range.")
    stats = data.stats_from_traces(df, data.TIME_RANGES[range_key])
    ok, phases = ui.guarded(cfg, lambda: loaders.load_phases(cfg.store, range_key, now))
    if not ok:
        return f"the trace store `{cfg.store}` could not be read (see above)"
    add_bench_tpot(cfg, stats)
    return stats, phases, data.handoff_histogram(df), f"trace store `{cfg.store}`"


def add_bench_tpot(cfg: ui.Config, stats: dict[str, data.ModeStats]) -> None:
    """TPOT from the store's latest bench run (the store has no per-request TPOT)."""
    ok, runs = ui.guarded(cfg, lambda: loaders.load_bench_runs(cfg.store, loaders.now_bucket()))
    run_id = runs[0]["run_id"] if ok and runs else None
    ok, df = ui.guarded(cfg, lambda: loaders.load_bench(cfg.store, run_id)) if run_id else (True, pd.DataFrame())
    for mode, (v, note) in benchdata.bench_tpot(df if ok else pd.DataFrame(), run_id).items():
        stats[mode].tpot_mean, stats[mode].tpot_note = v, note


def body(cfg: ui.Config, range_key: str) -> None:
    handoffhealthview.health_strip(cfg, range_key, TRACES_PAGE)
    got = from_prometheus(cfg, range_key) or from_store(cfg, range_key)
    if isinstance(got, str):
        no_figures(got)
        return
    stats, phases, hist, source = got
    st.caption(
        f"Source: {source}. Updated {datetime.now().strftime('%H:%M:%S')}. "
        "Handoff = prefill.finished (P) → kv.ready (D)."
    )
    crit = phases[phases["path"] == data.CRITICAL] if len(phases) else phases
    tot = crit.groupby("mode")["seconds"].sum() if len(crit) else pd.Series(dtype=float)
    ph_max = float(tot.max()) if len(tot) else None  # one x scale: push and pull bars compare
    h_max = float(hist["hi"].max()) if len(hist) else None
    words = data.breakdown_words(phases)
    units = row_units(stats)
    cols = st.columns(2, gap="large")
    for col, mode in zip(cols, data.MODES):
        with col, st.container(border=True, key=f"ov_{mode}"):
            st.subheader(MODE_TITLE.get(mode, mode))
            if not stats[mode].requests:
                figure_cards(f"no {mode} requests in this range")
                continue
            mode_figures(mode, stats[mode], source.startswith("Prometheus"), units)
            mode_charts(mode, phases, hist, ph_max, h_max, words.get(mode))
    pair_view(cfg, range_key)


#: The main figures' cards, in the order :func:`mode_figures` draws them.
MAIN_CARDS = ("handoff p50", "handoff p90", "handoff p99", "TTFT p50", "TTFT p99", "TPOT")


def figure_cards(why: str) -> None:
    """The main figures' cards of one mode, each "-" with ``why`` as its
    reason, said under them too: never a column without its figures."""
    for row in (MAIN_CARDS[:3], MAIN_CARDS[3:]):
        for col, name in zip(st.columns(3), row):
            col.metric(name, ui.MISSING, help=f"Not computed: {why}.")
    st.caption(f"No figures: {why}.")


def no_figures(why: str) -> None:
    """Both modes' columns with their main figures unknown, and why."""
    st.caption(f"Source: none. Updated {datetime.now().strftime('%H:%M:%S')}.")
    for col, mode in zip(st.columns(2, gap="large"), data.MODES):
        with col, st.container(border=True, key=f"ov_{mode}"):
            st.subheader(MODE_TITLE.get(mode, mode))
            figure_cards(why)


def row_units(stats: dict[str, data.ModeStats]) -> dict[str, tuple[str, float]]:
    """One time unit per row of cards, chosen from push's and pull's figures
    together, so that the two columns read across (``handoff``, ``ttft``)."""
    ms = [s for s in stats.values() if s.requests]
    return {
        "handoff": ui.time_unit([v for s in ms for v in s.handoff.values()]),
        "ttft": ui.time_unit([v for s in ms for v in (s.ttft.get("p50"), s.ttft.get("p99"), s.tpot_mean)]),
    }


HANDOFF_HELP = (
    "Handoff = prefill.finished (P) → kv.ready (D), {src}. "
    "Percentiles of the requests whose handoff is known; the links below list their traces."
)
DROPPED_HELP = (
    "Spans kvlens lost in this range, all processes, by reason: buffer_full (recorder buffer), "
    "queue_full (export queue), store (trace store locked or unwritable), export_failed (OTLP), "
    "shutdown (still queued at exit). Increase of kvlens_telemetry_dropped_total."
)


#: Where a mode's TTFT cards come from (``ModeStats.ttft_source``), in words.
TTFT_SOURCE_WORDS = {
    "router": "client-seen, at kvlens' router",
    "engines": "the engines' own (P's arrival → D's first token; another router)",
    "engines+router": "mixed: kvlens' router where it ran, else the engines' own",
}
TTFT_HELP = {
    "router": "Time to first token as the client sees it (kvlens' router: request in → first token out).",
    "engines": "Time to first token the engines prove without kvlens' router: P's arrival → D's first token, "
    "corrected for the P/D clock offset; it leaves out the router's own time.",
    "engines+router": "Client-seen TTFT where kvlens' router measured it, else the engines' own "
    "(P's arrival → D's first token).",
}


def mode_figures(mode: str, s: data.ModeStats, from_prom: bool, units: dict[str, tuple[str, float]]) -> None:
    """The metric cards of one mode (short values, the unit in the label, the
    same in both modes' columns: ``units``; detail in ``help``), and links
    from its handoff percentiles to the Traces page."""
    if s.pct_source == "store":
        src = "from the trace store" + (f": {s.pct_note}" if from_prom and s.pct_note else "")
    else:
        src = "from Prometheus' kvlens_handoff_seconds histogram" + (f": {s.pct_note}" if s.pct_note else "")
    unit, k = units["handoff"]
    st.caption(f"Handoff percentiles {src}.", help=HANDOFF_HELP.format(src=src))
    for col, (name, v) in zip(st.columns(3), s.handoff.items()):
        col.metric(f"handoff {name} ({unit})", ui.fmt_short(v, k))  # no ? icon: the label fits at 1280 px
    unit, k = units["ttft"]
    a, b, c = st.columns(3)
    ttft_help = TTFT_HELP.get(s.ttft_source if not from_prom else "router", TTFT_HELP["engines+router"])
    a.metric(f"TTFT p50 ({unit})", ui.fmt_short(s.ttft.get("p50"), k), help=ttft_help)
    b.metric(f"TTFT p99 ({unit})", ui.fmt_short(s.ttft.get("p99"), k), help=ttft_help)
    c.metric(f"TPOT ({unit})", ui.fmt_short(s.tpot_mean, k), help=s.tpot_note or "Mean time per output token.")
    if s.ttft_source and not from_prom:
        st.caption(f"TTFT: {TTFT_SOURCE_WORDS.get(s.ttft_source, s.ttft_source)}")
    a, b, c = st.columns(3)
    over = rate_words(s.rate_window_s)
    a.metric(
        "req/s",
        ui.fmt_rate(s.req_per_s),
        help=f"Requests per second over {over}: the time range, or the age of the data in it where that is "
        "shorter (a fleet 2 minutes old is not read as 2 minutes of traffic in an hour). The requests that started "
        "in that window are counted in the trace store where it holds this mode's requests (see the percentiles' "
        "source above), else Prometheus' increase().",
    )
    a.caption(f"{ui.fmt_n(s.requests)} requests, rate over {over}")
    bad = {k: v for k, v in s.outcomes.items() if k != sc.Outcome.OK.value}
    b.metric("ok", ui.fmt_n(s.outcomes.get(sc.Outcome.OK.value)), help="Requests that completed.")
    b.caption(" · ".join(f"{k} {ui.fmt_n(v)}" for k, v in bad.items()))
    c.metric(
        "lost spans",
        ui.fmt_n(s.dropped),
        help=DROPPED_HELP
        + (
            ""
            if s.dropped is not None
            else " Shown with --prometheus only: the trace store cannot count what never reached it."
        ),
    )
    if s.dropped_by_reason:
        c.caption(" · ".join(f"{k} {ui.fmt_n(v)}" for k, v in sorted(s.dropped_by_reason.items())))
    missing = [n for n, v in (("TPOT", s.tpot_mean), ("lost spans", s.dropped)) if v is None]
    if missing:
        # (not starting with "-": markdown would make it a list item)
        st.caption(f"{', '.join(missing)}: not available here, shown as “-” (hover ? for why).")
    links = st.columns(3)
    for lc, (name, v) in zip(links, s.handoff.items()):
        if v is not None:
            # a short label: "≥ p50 traces" is cut in a column at 1280 px
            lc.page_link(
                TRACES_PAGE,
                label=f"≥ {name}",
                icon=":material/search:",
                help=f"The traces with a handoff ≥ the {name} ({ui.fmt_ms(v)} ms).",
                query_params={"mode": mode, "min_handoff": f"{v:.6g}"},
            )


def rate_words(secs: float | None) -> str:
    """The window a rate covers, in words: ``the last 2 min 05 s``; ``an unknown window``."""
    if secs is None:
        return "an unknown window"
    secs = int(round(secs))
    if secs < 120:
        return f"the last {secs} s"
    if secs < 7200:
        return f"the last {secs // 60} min {secs % 60:02d} s"
    return f"the last {secs / 3600:.1f} h"


PAIR_HELP = (
    "One row per (mode, P engine, D engine), slowest handoff p50 first within a mode, over this "
    "range's traces in the trace store. ±: the median clock bound of the pair's handoffs (it decides "
    "the digits shown). × fastest: this pair's handoff p50 over the fastest pair's of the same mode. "
    "D − P clock: the window the store bounds D's clock minus P's to, for the pair's newest trace "
    "(each pair has its own; a window without 0 means D's spans were moved onto P's clock)."
)


def pair_view(cfg: ui.Config, range_key: str) -> None:
    """The handoff per (P, D) pair, so that one slow instance stands out.

    On the Overview rather than the Traces page: this is where an operator
    first asks "is it push or pull, and is it one instance?", over the same
    time range as the cards above; each row links to the Traces page filtered
    to its pair, where the filters by P and D engine also live."""
    try:
        df = loaders.load_pairs(cfg.store, range_key, loaders.now_bucket(range_key))
    except data.StoreMissing:  # (from Prometheus without a store: nothing to show per pair)
        return
    except data.StoreError as e:
        st.caption(f"Per-pair view unavailable: the trace store could not be read ({e}).")
        return
    if not len(df):
        return
    st.subheader("Handoff per (P, D) pair", help=PAIR_HELP)
    show = pd.DataFrame(
        {
            "mode": df["mode"],
            "pair": df["pair"],
            "requests": df["requests"],
            "handoff p50 (ms)": [ui.fmt_ms(h, e) for h, e in zip(df["handoff_p50_s"], df["err_p50_s"])],
            "handoff p90 (ms)": [ui.fmt_ms(h, e) for h, e in zip(df["handoff_p90_s"], df["err_p50_s"])],
            "± (ms)": [ui.fmt_err_ms(e) for e in df["err_p50_s"]],
            "× fastest": df["vs_best"],
            "TTFT p50 (ms)": [ui.fmt_ms(t) for t in df["ttft_p50_s"]],
            "D − P clock (ms)": [pairs.clock_window_text(lo, hi) for lo, hi in zip(df["clock_lo_s"], df["clock_hi_s"])],
            "traces": df["link"],
        }
    )
    text = st.column_config.TextColumn
    for line in standouts(df):
        st.markdown(line)
    st.dataframe(
        ui.table_view(show, {"× fastest": "{:.3g}×"}),
        hide_index=True,
        width="stretch",
        height=min(38 + 35 * len(show), 360),
        column_config={
            "handoff p50 (ms)": text("handoff p50 (ms)", help="-: no known handoff for this pair"),
            "± (ms)": text("± (ms)", help="median clock bound of the pair's handoffs; -: none known"),
            "× fastest": text("× fastest", help="handoff p50 ÷ the fastest pair's of this mode"),
            "TTFT p50 (ms)": text("TTFT p50 (ms)", help="-: no request of the pair has a TTFT"),
            "D − P clock (ms)": text("D − P clock (ms)", help="-: no clock window for this pair yet"),
            "traces": st.column_config.LinkColumn("traces", display_text="open"),
        },
    )


#: A pair whose handoff p50 is this many times its mode's fastest pair's is named above the table.
STANDOUT = 1.5


def standouts(df: pd.DataFrame) -> list[str]:
    """One line per pair that stands out from the other pairs of its mode."""
    out = []
    for r in df.itertuples():
        others = df[(df["mode"] == r.mode) & (df["pair"] != r.pair)]
        if len(others) and pd.notna(r.vs_best) and r.vs_best >= STANDOUT:
            out.append(
                f":material/warning: **{r.mode} {r.pair}**: handoff p50 {ui.fmt_ms(r.handoff_p50_s, r.err_p50_s)}"
                f" ms, {r.vs_best:.3g}× the fastest {r.mode} pair's."
            )
    return out


WORDS_HELP = (
    "Shares of the summed handoff time (prefill.finished → kv.ready) of this range's completed requests; "
    "each stretch of a handoff counts once, for the phase that started last over it. Unattributed: "
    "no phase names it (median per request in brackets). The same line as `kvlens traces`; "
    "the unnamed gaps are listed by `kvlens traces --breakdown`."
)


def mode_charts(
    mode: str,
    phases: pd.DataFrame,
    hist: pd.DataFrame,
    ph_max: float | None,
    h_max: float | None,
    words: str | None = None,
) -> None:
    """One mode's handoff histogram, what dominates its handoff in words, and
    its per-phase bars (critical path, then overlap)."""
    if hist is not None and len(hist[hist["mode"] == mode]):
        st.altair_chart(charts.handoff_hist_chart(hist, mode, h_max), width="stretch")
    mine = phases[phases["mode"] == mode] if phases is not None and len(phases) else pd.DataFrame()
    if not len(mine):
        st.caption("No completed handoffs with phase spans in this range.")
        return
    if words:
        st.markdown(f"**Where the handoff goes.** {words}", help=WORDS_HELP)
        st.markdown(cpushare.cpu_words(phases.attrs.get("cpu"), mode), help=cpushare.HELP)
    if (mine["path"] == data.CRITICAL).any():
        st.altair_chart(
            charts.phase_chart(
                phases, mode, data.CRITICAL, ph_max, "critical path by phase (prefill.finished → kv.ready)"
            ),
            width="stretch",
        )
    if (mine["path"] == data.OVERLAP).any():
        st.altair_chart(
            charts.phase_chart(phases, mode, data.OVERLAP, None, "overlapped with prefill (off the critical path)"),
            width="stretch",
        )
    else:
        st.caption("Nothing overlaps prefill: every phase starts after prefill.finished.")


if __name__ == "__main__":
    ui.run_page(main, "overview")
