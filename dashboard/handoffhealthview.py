"""Drawing the handoff health (docs/handoff-health.md): the Overview's strip and its
list of requests stuck now, and what the Traces page says of a partial or a
stale trace. Data from :mod:`dashboard.handoffhealth` / :func:`dashboard.prom.prom_health`
through the cached loaders."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pandas as pd
import streamlit as st

from dashboard import data
from dashboard import handoffhealth
from dashboard import loaders
from dashboard import prom, ui
from kvtrace import stuck
from kvtrace.stuck import SIDE

HEALTH_HELP = (
    "Handoffs that have not ended, and those that ended badly (docs/handoff-health.md). Open now and the oldest "
    "open age are live; the others count over the time range. A figure kvlens cannot know says "
    "\u201cunknown\u201d and why, never 0. Alert rules on the same metrics: docs/handoff-health.md, \u201cAlerts\u201d."
)
#: Most stuck requests listed as links (the rest: ``kvlens traces --open``).
STUCK_SHOWN = 20


def health_figures(cfg: ui.Config, range_key: str, stuck_df: pd.DataFrame | None, stuck_why: str) -> tuple:
    """(figures, source): from Prometheus when ``--prometheus`` is set and answers,
    else from the trace store; every figure unknown (with the reason) when neither can say."""
    if cfg.prometheus:
        try:
            return loaders.load_prom_health(
                cfg.prometheus, range_key, loaders.now_bucket()
            ), f"Prometheus at `{cfg.prometheus}`"
        except prom.PrometheusError as e:
            st.warning(f"Handoff health: Prometheus is unreachable or refused the query ({e}); from the trace store.")
    try:
        window = loaders.load_window(cfg.store, range_key, loaders.now_bucket(range_key))
    except (data.StoreMissing, data.StoreError) as e:
        why = f"no readable trace store ({e})"
        return {k: handoffhealth.Figure(None, unknown=why) for k in handoffhealth.HEALTH_FIGURES}, "nothing"
    figs = handoffhealth.health_from_store(
        window, stuck_df if stuck_df is not None else pd.DataFrame(columns=handoffhealth.STUCK_COLUMNS), range_key
    )
    if stuck_df is None:
        for k in ("open", "oldest_s"):
            figs[k] = handoffhealth.Figure(None, figs[k].help, unknown=stuck_why)
    return figs, f"trace store `{cfg.store}`"


def health_value(key: str, f: handoffhealth.Figure) -> str:
    """A strip card's value: ``unknown``, ``none`` (an age with nothing open), seconds, or a count."""
    if f.unknown:
        return "unknown"
    if f.value is None:
        return "none"
    return ui.fmt_short(f.value) if key == "oldest_s" else ui.fmt_n(f.value)


def health_strip(cfg: ui.Config, range_key: str, traces_page: str) -> None:
    """The health strip for the window, then the requests stuck now (from the
    store: Prometheus holds no request ids), each a link to its partial trace."""
    stuck_df, stuck_why = None, ""
    try:
        stuck_df = loaders.load_stuck(cfg.store, loaders.now_bucket())
    except (data.StoreMissing, data.StoreError) as e:
        stuck_why = f"the trace store cannot be read ({e})"
    figs, source = health_figures(cfg, range_key, stuck_df, stuck_why)
    with st.container(border=True, key="ov_health"):
        st.subheader("Handoff health", help=HEALTH_HELP)
        # two rows of three: six cards in one row cut "unknown" at a laptop's width (1280 px, sidebar open)
        items = list(handoffhealth.HEALTH_FIGURES.items())
        cols = [c for _ in range(0, len(items), 3) for c in st.columns(3)]
        for col, (key, label) in zip(cols, items):
            f = figs[key]
            unit = " (s)" if key == "oldest_s" else ""
            col.metric(
                label + unit, health_value(key, f), help=f.help + (f" Unknown: {f.unknown}." if f.unknown else "")
            )
            if f.unknown:
                col.caption(f"unknown: {f.unknown}")
        st.caption(f"Source: {source}; stuck requests: the trace store.")
        stuck_list(stuck_df, stuck_why, traces_page)


def stuck_list(df: pd.DataFrame | None, why: str, traces_page: str) -> None:
    """One link per handoff side stuck now, oldest first (to its partial trace on the Traces page)."""
    with st.container(key="ov_stuck"):
        st.markdown("**Stuck now**", help=handoffhealth.STUCK_HELP)
        if df is None:
            st.caption(f"Unavailable: {why}.")
            return
        if not len(df):
            st.caption(f"No handoff is stuck now (none open and reported in the last {handoffhealth.STUCK_FRESH_S} s).")
            return
        now = time.time_ns()  # the table may be a few seconds old (cached): ages from now
        for r in df.head(STUCK_SHOWN).itertuples():
            since = datetime.fromtimestamp(r.since_ns / 1e9).strftime("%H:%M:%S")
            age_s = max(now - r.since_ns, 0) / 1e9
            note = ", registration timed out" if r.registration_timeout else ""
            st.page_link(
                traces_page,
                label=f"{r.trace_id[:12]}… {r.mode}: {r.waiting} waiting in {r.phase} since {since} "
                f"({age_s:.1f} s{note})",
                icon=":material/hourglass_top:",
                help=f"request {r.request_id}; last reported {max(now - r.seen_ns, 0) / 1e9:.1f} s ago. "
                "Opens its partial trace.",
                query_params={"trace": r.trace_id},
            )
        if len(df) > STUCK_SHOWN:
            st.caption(f"{len(df) - STUCK_SHOWN} more: `kvlens traces --open` lists them all.")


def health_notes(rec: dict[str, Any]) -> None:
    """A partial trace says which side waits, in which phase, since when; a
    stale one that its answer is possibly served from reused memory."""
    for o in rec.get("open") or ():
        side = SIDE.get(o["waiting"], o["waiting"])
        flag = (
            " D's push registration timed out (vLLM's soft watchdog); the request kept waiting."
            if o.get("registration_timeout")
            else ""
        )
        st.warning(
            f"**Partial trace: the handoff has not ended.** {side} ({o['waiting']}) waiting in "
            f"`{o['phase']}` since {ui.fmt_ts(o['since_ns'])}, {o['waited_s']:.1f} s at its last report "
            f"({ui.fmt_ts(o['last_seen_ns'])}).{flag} The complete trace replaces this one when it ends.",
            icon=":material/hourglass_top:",
        )
    if rec.get("stale"):
        st.error(
            f"**Possibly served from reused memory**: {stuck.STALE_WHY} (kvlens.kv.stale).", icon=":material/warning:"
        )
