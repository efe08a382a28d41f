"""Traces page: the slowest requests under filters (mode, outcome, time
range, handoff bounds, N, order) and one trace's P+D waterfall with the
critical path marked.

The filters can be pre-set from the URL (``?page=traces&mode=push&min_handoff=0.12``,
the links of the Overview page) and the URL follows the filters, so a view
can be shared.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import charts
from dashboard import data as D
from dashboard import loaders as L
from dashboard import ui

#: Query param -> the widget key it pre-sets.
QUERY_KEYS = {"mode": "tr_mode", "outcome": "tr_outcome", "range": "tr_range", "min_handoff": "tr_min",
              "max_handoff": "tr_max", "n": "tr_n", "order": "tr_order", "trace": "tr_trace"}
#: Filter defaults (kept in session state, not in the widgets' value=, so that
#: query params can pre-set any of them without Streamlit's double-default warning).
DEFAULTS = {"tr_mode": "any", "tr_outcome": "any", "tr_range": "all", "tr_min": None, "tr_max": None,
            "tr_n": 50, "tr_order": "handoff"}


def main() -> None:
    cfg = ui.parse_config()
    st.title("Traces: slowest requests")
    apply_query_params()
    if ui.store_banner(cfg) is None:
        return
    for k, v in DEFAULTS.items():
        st.session_state.setdefault(k, v)
    f = filters()
    ok, df = ui.guarded(cfg, lambda: L.load_slowest(
        cfg.store, f["n"], None if f["mode"] == "any" else f["mode"],
        None if f["outcome"] == "any" else f["outcome"], f["range"], L.now_bucket(f["range"]),
        f["min_h"], f["max_h"], f["order"]))
    if not ok:
        return
    if not len(df):
        st.info("No traces match these filters.")
        return
    slowest_table(df)
    tid = pick_trace(df)
    sync_url(f, tid)
    trace_view(cfg, tid)


def _float_or_none(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f else None


def apply_query_params() -> None:
    """Pre-set the filters from the URL (``?mode=push&min_handoff=0.12``),
    once per distinct set of params so later widget changes stick."""
    qp = {k: st.query_params.get(k) for k in QUERY_KEYS if st.query_params.get(k) is not None}
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


def filters() -> dict[str, Any]:
    """The filter widgets; their values (mode, outcome, range, min_h, max_h in s, n, order)."""
    f = st.columns([1, 1, 1, 1, 1, 1])
    return {
        "mode": f[0].selectbox("Mode", ["any", *D.MODES], key="tr_mode"),
        "outcome": f[1].selectbox("Outcome", ["any", *D.OUTCOMES], key="tr_outcome"),
        "range": f[2].selectbox("Started in the last", list(D.TIME_RANGES), key="tr_range"),
        "min_h": f[3].number_input("Min handoff (s)", min_value=0.0, value=None, step=0.001, format="%.4f",
                                   key="tr_min"),
        "max_h": f[4].number_input("Max handoff (s)", min_value=0.0, value=None, step=0.001, format="%.4f",
                                   key="tr_max"),
        "n": int(f[5].number_input("Show N", min_value=1, max_value=500, step=10, key="tr_n")),
        "order": st.radio("Order by", ["handoff", "ttft"], horizontal=True, key="tr_order"),
    }


def slowest_table(df: pd.DataFrame) -> None:
    """The listed traces, times in ms; ``-`` where a figure is missing (the column's help says why)."""
    show = df.assign(
        started_utc=pd.to_datetime(df["start_ns"], unit="ns").dt.strftime("%Y-%m-%d %H:%M:%S"),
        handoff_ms=df["handoff_s"] * 1e3, err_ms=df["handoff_err_s"] * 1e3, ttft_ms=df["ttft_s"] * 1e3,
    )[["trace_id", "mode", "dispatch", "outcome", "handoff_ms", "err_ms", "ttft_ms", "n_spans", "started_utc",
       "request_id", "handoff_note"]]
    text = st.column_config.TextColumn
    st.dataframe(ui.table_view(show, {"handoff_ms": ".3f", "err_ms": ".3f", "ttft_ms": ".3f", "n_spans": ",.0f"}),
                 hide_index=True, width="stretch", height=min(38 + 35 * len(show), 320),
                 column_config={"handoff_ms": text("handoff (ms)", help="-: no kv.ready (the request failed "
                                                   "first) or P/D clocks not bounded; see note"),
                                "err_ms": text("± (ms)", help="bound from the P/D clock offset interval; "
                                               "-: no handoff or no bound"),
                                "ttft_ms": text("TTFT (ms)", help="-: no first token (the request failed)"),
                                "n_spans": text("spans"),
                                "request_id": text("request_id", help="-: the router saw no request id"),
                                "handoff_note": text("note", help="why a handoff is unknown; -: nothing to note")})


def pick_trace(df: pd.DataFrame) -> str:
    """The trace picker over the listed traces (the URL's ``trace`` when listed, else the first)."""
    ids = list(df["trace_id"])
    want = st.session_state.pop("_tr_want_trace", None)
    if want and want in ids:
        st.session_state["tr_trace"] = want
    if st.session_state.get("tr_trace") not in ids:
        st.session_state["tr_trace"] = ids[0]
    info = {r.trace_id: r for r in df.itertuples()}

    def label(tid: str) -> str:
        r = info[tid]
        h = ui.fmt_handoff(r.handoff_s, r.handoff_err_s, r.handoff_note) if pd.notna(r.handoff_s) or r.handoff_note \
            else "no handoff"
        return f"{tid[:12]}…  {r.mode}  {r.outcome}  handoff {h}"

    return st.selectbox("Trace", ids, format_func=label, key="tr_trace")


def sync_url(f: dict[str, Any], tid: str) -> None:
    """Keep the URL in step with the filters, so the view can be shared."""
    st.query_params.from_dict({k: v for k, v in {
        "page": "traces", "mode": None if f["mode"] == "any" else f["mode"],
        "outcome": None if f["outcome"] == "any" else f["outcome"], "range": f["range"],
        "min_handoff": None if f["min_h"] is None else f"{f['min_h']:.6g}",
        "max_handoff": None if f["max_h"] is None else f"{f['max_h']:.6g}", "trace": tid}.items() if v is not None})
    st.session_state["_tr_applied"] = tuple(sorted(
        (k, v) for k, v in st.query_params.to_dict().items() if k in QUERY_KEYS))


def trace_view(cfg: ui.Config, tid: str) -> None:
    """One trace: mode, outcome, handoff and TTFT split, its waterfall and its spans."""
    ok, res = ui.guarded(cfg, lambda: L.load_trace(cfg.store, tid))
    if not ok:
        return
    rec, spans = res
    if rec is None or not len(spans):
        st.info("This trace has no spans in the store.")
        return
    dec = rec["decomposition"]
    m = st.columns(6)
    m[0].metric("mode", rec["mode"] or ui.MISSING)
    m[1].metric("outcome", rec["outcome"] or ui.MISSING)
    m[2].metric("handoff", ui.fmt_handoff(rec["handoff_s"], rec["handoff_err_s"], rec["handoff_note"]),
                help=rec["handoff_note"] or "± the bound from the P/D clock offset interval")
    m[3].metric("TTFT (client)", ui.fmt_s(rec["ttft_s"]))
    m[4].metric("queue + prefill", ui.fmt_s(dec["queue_prefill_s"]))
    m[5].metric("first decode step", ui.fmt_s(dec["first_decode_s"]))
    st.caption(f"trace `{rec['trace_id']}` · request `{rec['request_id']}` · dispatch {rec.get('dispatch') or 'n/a'} · "
               f"{ui.clock_caption(rec)} "
               "Red outline: on the critical path (prefill.finished → kv.ready); ◆ point phases.")
    st.altair_chart(charts.waterfall_chart(spans, rec["critical_ms"]), width="stretch")
    st.dataframe(
        ui.table_view(spans[["role", "phase", "start_ms", "duration_ms", "critical", "outcome", "attributes"]],
                      {"start_ms": ".3f", "duration_ms": ".3f"}),
        hide_index=True, width="stretch",
        column_config={"start_ms": st.column_config.TextColumn("start (ms)"),
                       "duration_ms": st.column_config.TextColumn("duration (ms)"),
                       "outcome": st.column_config.TextColumn("outcome", help="-: a point phase has no outcome")},
    )


if __name__ == "__main__":
    ui.run_page(main, "traces")
