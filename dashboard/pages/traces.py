"""Traces page: the slowest requests under filters (mode, outcome, time
range, handoff bounds, N, order, P engine, D engine) and one trace's P+D
waterfall with the critical path marked.

The filters can be pre-set from the URL (``?page=traces&mode=push&min_handoff=0.12``,
the links of the Overview page) and the URL follows the filters, so a view
can be shared.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import charts
from dashboard import data
from dashboard import loaders
from dashboard import handoffhealthview, ui
from dashboard.pairs import pair_label
from kvrecord import semconv as sc

#: How a side is named next to its ranks.
ROLE_WORD = {sc.Role.PREFILL.value: "P", sc.Role.DECODE.value: "D"}

#: Query param -> the widget key it pre-sets.
QUERY_KEYS = {
    "mode": "tr_mode",
    "outcome": "tr_outcome",
    "range": "tr_range",
    "min_handoff": "tr_min",
    "max_handoff": "tr_max",
    "n": "tr_n",
    "order": "tr_order",
    "trace": "tr_trace",
    "p_engine": "tr_p",
    "d_engine": "tr_d",
}
#: Filter defaults (kept in session state, not in the widgets' value=, so that
#: query params can pre-set any of them without Streamlit's double-default warning).
DEFAULTS = {
    "tr_mode": "any",
    "tr_outcome": "any",
    "tr_range": "all",
    "tr_min": None,
    "tr_max": None,
    "tr_n": 50,
    "tr_order": "handoff",
    "tr_p": "any",
    "tr_d": "any",
}


def main() -> None:
    cfg = ui.parse_config()
    st.title("Traces: slowest requests")
    apply_query_params()
    if ui.store_banner(cfg) is None:
        return
    for k, v in DEFAULTS.items():
        st.session_state.setdefault(k, v)
    ok, pairs = ui.guarded(cfg, lambda: loaders.load_engines(cfg.store, loaders.now_bucket()))
    if not ok:
        return
    f = filters(pairs)
    ok, df = ui.guarded(
        cfg,
        lambda: loaders.load_slowest(
            cfg.store,
            f["n"],
            _any(f["mode"]),
            _any(f["outcome"]),
            f["range"],
            loaders.now_bucket(f["range"]),
            f["min_h"],
            f["max_h"],
            f["order"],
            _any(f["p"]),
            _any(f["d"]),
        ),
    )
    if not ok:
        return
    if not len(df):
        st.info("No traces match these filters.")
        return
    slowest_table(df)
    tid = pick_trace(df)
    sync_url(f, tid)
    trace_view(cfg, tid)


def _any(v: str | None) -> str | None:
    """A picker's value as a filter: "any" filters nothing."""
    return None if v in (None, "any") else v


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
    ss["tr_mode"] = qp["mode"] if qp.get("mode") in data.MODES else "any"
    ss["tr_outcome"] = qp["outcome"] if qp.get("outcome") in data.OUTCOMES else "any"
    ss["tr_range"] = qp["range"] if qp.get("range") in data.TIME_RANGES else "all"
    ss["tr_min"] = _float_or_none(qp.get("min_handoff"))
    ss["tr_max"] = _float_or_none(qp.get("max_handoff"))
    if _float_or_none(qp.get("n")):
        ss["tr_n"] = int(min(max(_float_or_none(qp["n"]), 1), 500))
    if qp.get("order") in ("handoff", "ttft"):
        ss["tr_order"] = qp["order"]
    if qp.get("trace"):
        ss["_tr_want_trace"] = qp["trace"]
    ss["tr_p"] = qp.get("p_engine") or "any"
    ss["tr_d"] = qp.get("d_engine") or "any"


def engine_options(pairs: list[tuple[str | None, str | None]], side: int, key: str) -> list[str]:
    """A P (side 0) or D (side 1) engine picker's choices: "any", then the
    engines the store has seen (and the one the URL asked for, if it has not)."""
    seen = sorted({p[side] for p in pairs if p[side]})
    want = st.session_state.get(key)
    return ["any", *seen, *([want] if want and want != "any" and want not in seen else [])]


def filters(pairs: list[tuple[str | None, str | None]]) -> dict[str, Any]:
    """The filter widgets; their values (mode, outcome, range, min_h, max_h in s, n, order, p, d engines)."""
    f = st.columns([1, 1, 1, 1, 1, 1])
    g = st.columns([2, 1, 1])
    return {
        "mode": f[0].selectbox("Mode", ["any", *data.MODES], key="tr_mode"),
        "outcome": f[1].selectbox("Outcome", ["any", *data.OUTCOMES], key="tr_outcome"),
        "range": f[2].selectbox("Started in the last", list(data.TIME_RANGES), key="tr_range"),
        "min_h": f[3].number_input(
            "Min handoff (s)", min_value=0.0, value=None, step=0.001, format="%.4f", key="tr_min"
        ),
        "max_h": f[4].number_input(
            "Max handoff (s)", min_value=0.0, value=None, step=0.001, format="%.4f", key="tr_max"
        ),
        "n": int(f[5].number_input("Show N", min_value=1, max_value=500, step=10, key="tr_n")),
        "order": g[0].radio("Order by", ["handoff", "ttft"], horizontal=True, key="tr_order"),
        "p": g[1].selectbox(
            "P engine",
            engine_options(pairs, 0, "tr_p"),
            key="tr_p",
            help="Only the traces this prefill instance served (engine id).",
        ),
        "d": g[2].selectbox(
            "D engine",
            engine_options(pairs, 1, "tr_d"),
            key="tr_d",
            help="Only the traces this decode instance served (engine id).",
        ),
    }


def slowest_table(df: pd.DataFrame) -> None:
    """The listed traces, times in ms, each handoff to the digits its clock bound
    supports (``ui.fmt_ms``); ``-`` where a figure is missing (the column's help says why)."""
    show = df.assign(
        started_utc=pd.to_datetime(df["start_ns"], unit="ns").dt.strftime("%Y-%m-%d %H:%M:%S"),
        handoff_ms=[ui.fmt_ms(h, e) for h, e in zip(df["handoff_s"], df["handoff_err_s"])],
        err_ms=[ui.fmt_err_ms(e) for e in df["handoff_err_s"]],
        ttft_ms=[ui.fmt_ms(t) for t in df["ttft_s"]],
        pair=[pair_label(p, d) for p, d in zip(df["p_engine"], df["d_engine"])],
    )[
        [
            "trace_id",
            "mode",
            "dispatch",
            "outcome",
            "handoff_ms",
            "err_ms",
            "ttft_ms",
            "pair",
            "n_spans",
            "started_utc",
            "request_id",
            "handoff_note",
        ]
    ]
    text = st.column_config.TextColumn
    st.dataframe(
        ui.table_view(show, {"n_spans": ",.0f"}),
        hide_index=True,
        width="stretch",
        height=min(38 + 35 * len(show), 320),
        column_config={
            "handoff_ms": text(
                "handoff (ms)",
                help="to the digits its ± supports; -: no kv.ready "
                "(the request failed first) or P/D clocks not bounded; see note",
            ),
            "err_ms": text("± (ms)", help="bound from the P/D clock offset interval; -: no handoff or no bound"),
            "ttft_ms": text("TTFT (ms)", help="-: no first token (the request failed)"),
            "pair": text("P → D", help="the engines that served it (?: not recorded)"),
            "n_spans": text("spans"),
            "request_id": text("request_id", help="-: the router saw no request id"),
            "handoff_note": text("note", help="why a handoff is unknown; -: nothing to note"),
        },
    )


def pick_trace(df: pd.DataFrame) -> str:
    """The trace picker over the listed traces (the URL's ``trace`` when listed, else the first)."""
    ids = list(df["trace_id"])
    want = st.session_state.pop("_tr_want_trace", None)
    if want:
        st.session_state["tr_trace"] = st.session_state["_tr_linked"] = want
    linked = st.session_state.get("_tr_linked")
    if linked and linked not in ids:  # a shared link to a trace the filters leave out: offered all the same
        ids.insert(0, linked)
    if st.session_state.get("tr_trace") not in ids:
        st.session_state["tr_trace"] = ids[0]
    info = {r.trace_id: r for r in df.itertuples()}

    def label(tid: str) -> str:
        if tid not in info:
            return f"{tid[:12]}…  (from the link; not in the list above)"
        r = info[tid]
        h = (
            ui.fmt_handoff(r.handoff_s, r.handoff_err_s, r.handoff_note)
            if pd.notna(r.handoff_s) or r.handoff_note
            else "no handoff"
        )
        return f"{tid[:12]}…  {r.mode}  {r.outcome}  handoff {h}"

    return st.selectbox("Trace", ids, format_func=label, key="tr_trace")


def sync_url(f: dict[str, Any], tid: str) -> None:
    """Keep the URL in step with the filters, so the view can be shared."""
    st.query_params.from_dict(
        {
            k: v
            for k, v in {
                "page": "traces",
                "mode": None if f["mode"] == "any" else f["mode"],
                "outcome": None if f["outcome"] == "any" else f["outcome"],
                "range": f["range"],
                "min_handoff": None if f["min_h"] is None else f"{f['min_h']:.6g}",
                "max_handoff": None if f["max_h"] is None else f"{f['max_h']:.6g}",
                "p_engine": _any(f["p"]),
                "d_engine": _any(f["d"]),
                "trace": tid,
            }.items()
            if v is not None
        }
    )
    st.session_state["_tr_applied"] = tuple(
        sorted((k, v) for k, v in st.query_params.to_dict().items() if k in QUERY_KEYS)
    )


def trace_view(cfg: ui.Config, tid: str) -> None:
    """One trace: mode, outcome, handoff and TTFT split, its waterfall and its spans."""
    ok, res = ui.guarded(cfg, lambda: loaders.load_trace(cfg.store, tid))
    if not ok:
        return
    rec, spans = res
    if rec is not None and not len(spans) and rec.get("keep") == "no":  # --keep sampled: the summary only
        trace_cards(rec)
        st.info(f"{rec.get('spans_note', 'summary only')}. Its phases (longest copy each, from the summary):")
        rows = [{"phase": k, "duration_ms": round(v * 1000, 3)} for k, v in (rec.get("phases_s") or {}).items()]
        st.dataframe(rows, hide_index=True, width="stretch")
        return
    if rec is None or not len(spans):
        st.info("This trace has no spans in the store.")
        return
    trace_cards(rec)
    handoffhealthview.health_notes(rec)
    st.caption(
        f"trace `{rec['trace_id']}` · request `{rec['request_id']}` · dispatch {rec.get('dispatch') or 'n/a'} · "
        f"P → D `{pair_label(rec.get('p_engine'), rec.get('d_engine'))}` · {ui.clock_caption(rec)} "
        "Red outline: on the critical path (prefill.finished → kv.ready); ◆ point phases."
    )
    use = rec.get("kv_use") or {}
    if use.get("recomputed"):
        st.warning(
            f"D computed {use['recomputed_tokens']:,} prompt tokens itself at its first step, more than the "
            "last partial block: the KV that moved was not used (counted in kvlens_kv_recomputed_total)."
        )
    per_rank = rank_controls(rec)
    st.altair_chart(
        charts.waterfall_chart(
            spans,
            rec["critical_ms"],
            ui.fmt_handoff(rec["handoff_s"], rec["handoff_err_s"], rec["handoff_note"]),
            per_rank=per_rank,
        ),
        width="stretch",
    )
    st.dataframe(
        ui.table_view(span_rows(spans, rec["handoff_err_s"])),
        hide_index=True,
        width="stretch",
        column_config={
            "start_ms": st.column_config.TextColumn(
                "start (ms)",
                help="from the trace's start; D's spans to the digits the handoff's ± supports, the others to 0.1 ms",
            ),
            "duration_ms": st.column_config.TextColumn(
                "duration (ms)", help="on one clock: 3 significant digits, whole ms at least"
            ),
            "outcome": st.column_config.TextColumn("outcome", help="-: a point phase has no outcome"),
            "rank": st.column_config.TextColumn(
                "rank", help="the TP rank whose worker recorded it; -: a scheduler-side phase"
            ),
        },
    )


def rank_controls(rec: dict[str, Any]) -> bool:
    """For a trace recorded on several TP ranks: the ranks seen per side, the
    straggler of each per-rank completion phase (the rank the request waited
    for, and its lag behind the first), and the lanes toggle (one lane per
    rank, or a phase's ranks in one lane). False (ranks together) otherwise."""
    info = rec.get("ranks") or {}
    tp = {role: n for role, n in (info.get("tp") or {}).items() if n > 1}
    if not tp:
        return False
    sides = ", ".join(f"{ROLE_WORD.get(role, role)} {n} ranks" for role, n in sorted(tp.items()))
    lines = [f"Tensor parallel: {sides}."]
    for x in info.get("stragglers") or ():
        lines.append(
            f"Straggler: {ROLE_WORD.get(x['role'], x['role'])} rank {x['rank']} finished `{x['phase']}` "
            f"last, {ui.fmt_ms(x['lag_s'])} ms after rank {x['first_rank']} ({x['ranks']} ranks; "
            "the request waits for the last)."
        )
    st.caption("  \n".join(lines))
    return st.toggle(
        "One lane per TP rank", value=True, key="tr_rank_lanes", help="off: each phase's ranks share one lane"
    )


def span_rows(spans: pd.DataFrame, err_s: float | None) -> pd.DataFrame:
    """The span table: D's starts (moved onto P's clock) to the digits the
    trace's clock bound supports, the others to 0.1 ms; durations (each on one
    clock) to 3 significant digits."""
    cols = ["role", "rank", "phase", "start_ms", "duration_ms", "critical", "outcome", "attributes"]
    out = spans[[c for c in cols if c != "rank" or spans["rank"].notna().any()]].copy()
    if "rank" in out:
        out["rank"] = [None if pd.isna(r) else int(r) for r in out["rank"]]
    out["start_ms"] = [
        ui.fmt_ms(v / 1e3, err_s) if role == sc.Role.DECODE.value else f"{v:,.1f}"
        for v, role in zip(spans["start_ms"], spans["role"])
    ]
    out["duration_ms"] = [ui.fmt_ms(v / 1e3) for v in spans["duration_ms"]]
    return out


def trace_cards(rec: dict[str, Any]) -> None:
    """One trace's cards: short values in one time unit (in the labels) so that
    every card is whole at 1280 px; the handoff's exact figure and its ± below it."""
    dec = rec["decomposition"]
    h, err, note = rec["handoff_s"], rec["handoff_err_s"], rec["handoff_note"]
    times = {
        "handoff": h,
        "TTFT": rec["ttft_s"],
        "prefill": dec["queue_prefill_s"],
        "first decode": dec["first_decode_s"],
    }
    unit, k = ui.time_unit(times.values())
    m = st.columns(6)
    m[0].metric("mode", rec["mode"] or ui.MISSING)
    m[1].metric("outcome", "open" if rec.get("open") else rec["outcome"] or ui.MISSING)
    helps = {
        "handoff": note
        or "prefill.finished (P) → kv.ready (D), on P's clock; the exact figure and its clock bound below",
        "TTFT": "time to first token as the client saw it (router)",
        "prefill": "queue + prefill: router arrival → prefill.finished (P)",
        "first decode": "kv.ready → first token (D)",
    }
    for col, (name, v) in zip(m[2:], times.items()):
        col.metric(f"{name} ({unit})", ui.fmt_short(v, k), help=helps[name])
    if h is not None:
        m[2].caption(ui.fmt_handoff(h, err, note))
    elif note:
        m[2].caption("unknown: see the note below")


if __name__ == "__main__":
    ui.run_page(main, "traces")
