"""The live verdict and the what-if on the dashboard (issue 31): the
Overview's first line and the Compare page's "predicted against measured".

The figures are :mod:`kvtrace.verdict`'s and :mod:`kvtrace.whatif`'s, the
same ``kvlens verdict`` and ``kvlens whatif`` print, loaded by
:mod:`dashboard.data` and cached by :mod:`dashboard.loaders`.
"""

from __future__ import annotations

import time


import pandas as pd
import streamlit as st

from dashboard import data
from dashboard import loaders
from dashboard import ui
from kvtrace import stats
from kvtrace import verdict as kv_verdict
from kvtrace import whatif as kv_whatif

#: The headline's window: the CLI's default (``kvlens verdict --window 1h``).
VERDICT_WINDOW = "1h"
#: Seconds between the headline's refreshes (its own fragment, apart from the page's body),
#: and the step its window moves by: a verdict over 20,000 requests costs ~2 s of CPU.
HEADLINE_EVERY_S = 30
#: The figures the headline names (the rest: ``kvlens verdict``).
HEADLINE_METRICS = ("ttft_p50", "handoff_p50")


def headline_text(v: kv_verdict.Verdict) -> str:
    """The Overview's first line (pure): the TTFT p50 and handoff p50 ratios
    with their intervals, or why there is no verdict."""
    if v.status != "ok":
        return f"**Verdict, last {VERDICT_WINDOW}:** {v.message}."
    words = {k: w for k, _, _, w in kv_verdict.METRICS}
    parts = [f"{words[k]} push/pull {kv_verdict.ratio_words(v.ratios[k])}" for k in HEADLINE_METRICS]
    head = f"**Verdict, last {VERDICT_WINDOW}** ({v.selection_words()}, {v.message}): " + "; ".join(parts) + "."
    cw = kv_verdict.cpu_words(v)
    if cw is None:
        return head + " CPU wait in the handoff: unknown (no request carries CPU figures)."
    nowait = kv_verdict.ratio_words(v.ratios["handoff_nowait_p50"])
    return f"{head} {cw[0].upper() + cw[1:]}; handoff p50 push/pull with CPU wait removed {nowait}."


def headline(cfg) -> None:
    """Draw the live verdict as the page's first line (its own fragment,
    refreshed every :data:`HEADLINE_EVERY_S`); a store that cannot be read is
    left to the page's own banner below."""

    def draw() -> None:
        since, _ = data.since_until(VERDICT_WINDOW, time.time() // HEADLINE_EVERY_S * HEADLINE_EVERY_S)
        try:
            v = loaders.load_verdict(cfg.store, since)
        except data.StoreError:
            st.markdown(f"**Verdict, last {VERDICT_WINDOW}:** unknown: the trace store cannot be read (below).")
            return
        st.markdown(headline_text(v))

    st.fragment(run_every=HEADLINE_EVERY_S)(draw)()


def verdict_rows(v: kv_verdict.Verdict) -> pd.DataFrame:
    """The verdict's ratios, one row per figure (pure): push/pull, its 95 %
    interval and what it allows, or "not enough data" and why; never a ratio
    without its interval."""
    rows = []
    for key, _, _, words in kv_verdict.METRICS:
        r = v.ratios.get(key)
        if r is None:
            continue
        known = r.status != stats.NOT_ENOUGH and r.lo is not None and r.hi is not None
        rows.append(
            {
                "figure": words,
                "push/pull": f"{r.ratio:.2f}" if known else "-",
                "95 % interval": f"{r.lo:.2f}-{r.hi:.2f}" if known else "-",
                "verdict": kv_verdict.ratio_words(r).split(": ", 1)[-1] if known else kv_verdict.ratio_words(r),
            }
        )
    return pd.DataFrame(rows)


def whatif_rows(results: list[kv_whatif.WhatIf]) -> pd.DataFrame:
    """One row per predicted mode and figure: predicted p50 [interval], the
    measured p50 of that mode in the same window, the error, inside or not,
    and the error sampling alone would give (pure)."""
    rows = []
    for w in results:
        for key, fig, name in (
            ("handoff", w.handoff, "handoff p50"),
            ("ttft", w.ttft, "TTFT p50"),
            ("handoff_nowait", w.handoff_nowait, "handoff p50 without CPU wait"),
        ):
            m = w.measured_to.get(f"{key}_p50_s")
            inside = w.measured_to.get(f"{key}_in_interval")
            err = w.measured_to.get(f"{key}_error")
            floor = w.measured_to.get(f"{key}_floor")
            rows.append(
                {
                    "predicted": f"{w.to_mode} (from {w.used} {w.from_mode} requests)",
                    "figure": name,
                    "predicted (ms)": _ms(fig.p50),
                    "95 % interval (ms)": "-" if fig.lo is None else f"{fig.lo * 1e3:.1f}-{fig.hi * 1e3:.1f}",
                    "measured (ms)": _ms(m),
                    "error": "-" if err is None else f"{err * 100:+.0f} %",
                    "inside": "-" if inside is None else ("yes" if inside else "no"),
                    # what the measured p50 moves by from sampling alone (kvtrace.stats.sampling_floor)
                    "sampling alone": "-" if floor is None else f"±{floor * 100:.0f} %",
                }
            )
    return pd.DataFrame(rows)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def whatif_compare(cfg, range_key: str) -> None:
    """The Compare page's section: each mode predicted from the other's
    traces of the range, against what that mode measured there."""
    since, _ = data.since_until(range_key, loaders.now_bucket(range_key))
    got = []
    for src in (kv_whatif.PULL, kv_whatif.PUSH):
        ok, w = ui.guarded(cfg, lambda src=src: loaders.load_whatif(cfg.store, since, src))
        if not ok:
            return
        got.append(w)
    usable = [w for w in got if w.status == "ok"]
    if not usable:
        why = "; ".join(f"from {w.from_mode}: {w.note}" for w in got)
        st.info(f"No what-if in the last {range_key} ({stats.NOT_ENOUGH}: {why}).")
        return
    st.dataframe(whatif_rows(usable), hide_index=True, width="stretch")
    if any(not w.measured_to.get("n") for w in usable):
        st.caption("-: that mode has no measured request in this range; the prediction stands alone.")
    with st.expander("Borrowed figures and assumptions"):
        for w in usable:
            st.markdown(f"**{w.to_mode} from {w.from_mode}**")
            st.markdown("\n".join(f"- {a}" for a in w.assumptions()))
    st.caption("Method: docs/verdict.md; the same figures as `kvlens whatif --from pull|push --json`.")
