"""CPU or wire on the Overview's "where the handoff goes": the CPU-wait shares
(per mode at the median request, per phase of its critical-path time) from a
store written through the real span pipeline, "unknown (why)" where the spans
carry no figures, and the sentence on the page (AppTest)."""

from __future__ import annotations

import time

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from test_dashboard import app, no_exception, store_path  # noqa: F401  (fixtures)

from dashboard import cpushare
from dashboard import data
from kvrecord import semconv as sc
from kvtrace import cpusplit
from kvtrace.store import StoreSpanExporter

MS = 1_000_000


def _pull_store(tmp_path, waits_ms: list[float], unknown_post: bool = False, before: dict | None = None):
    """Pull requests, one host, through the store writer: D's descriptor.prep
    (0.2 ms, no wait), read.post (2 ms) and read.complete (8 ms) carry the
    engine thread's figures (``waits_ms``: read.complete's CPU wait per
    request; read.post 0.5 ms of wait, or unknown); alloc -> descriptor.prep
    is the derived decode.dispatch."""
    db = tmp_path / "traces.db"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(StoreSpanExporter(db)))
    tracer = provider.get_tracer("t")
    now = time.time_ns() - 60 * 10**9
    for i, wait in enumerate(waits_ms):
        tid = f"{i + 1:032x}"
        ctx = otel_trace.set_span_in_context(NonRecordingSpan(SpanContext(int(tid, 16), 7, True, TraceFlags(1))))
        t = now + i * 10**9
        P = {sc.ATTR_MODE: "pull", sc.ATTR_ROLE: "prefill", sc.ATTR_OUTCOME: "ok"}
        Dd = {sc.ATTR_MODE: "pull", sc.ATTR_ROLE: "decode", sc.ATTR_OUTCOME: "ok"}
        post = (
            {sc.ATTR_CPU_UNKNOWN: "no reading of the thread at or before the phase's start"}
            if unknown_post
            else {sc.ATTR_CPU_ON_S: 0.001, sc.ATTR_CPU_WAIT_S: 0.0005}
        )
        done = {sc.ATTR_CPU_ON_S: 0.001, sc.ATTR_CPU_WAIT_S: wait / 1000}
        for name, a, t0, t1 in (
            ("prefill.finished", P, t, t),
            ("alloc", Dd, t + MS // 2, t + MS // 2),
            (
                "descriptor.prep",
                {**Dd, sc.ATTR_CPU_ON_S: 0.0002, sc.ATTR_CPU_WAIT_S: 0.0, **(before or {})},
                t + 8 * MS // 10,
                t + MS,
            ),
            ("read.post", {**Dd, **post}, t + MS, t + 3 * MS),
            ("read.complete", {**Dd, **done}, t + 3 * MS, t + 11 * MS),
            ("kv.released", P, t + 11 * MS, t + 11 * MS),
            ("kv.ready", Dd, t + 11 * MS, t + 11 * MS),
            ("request", {sc.ATTR_MODE: "pull", sc.ATTR_ROLE: "router", sc.ATTR_OUTCOME: "ok"}, t - MS, t + 13 * MS),
        ):
            tracer.start_span(name, context=ctx, attributes=a, start_time=t0).end(end_time=t1)
    provider.shutdown()
    return db


def test_shares_from_the_store(tmp_path):
    db = _pull_store(tmp_path, [1.0, 2.0, 4.0])
    ph = data.phase_breakdown(db, None, None)
    c = ph.attrs["cpu"]["pull"]
    assert c["known"] == 3 and not c["unknown"]
    # handoff 11 ms: read.post 0.5 ms + read.complete's wait, the median request (2 ms): 2.5 / 11
    assert c["median"] == pytest.approx(2.5 / 11)
    # read.complete: 7 ms of waits over 3 x 8 ms; read.post 1.5 ms over 3 x 2 ms
    assert c["phases"]["read.complete"] == pytest.approx(7 / 24)
    assert c["phases"]["read.post"] == pytest.approx(0.25)
    # the derived phases (D's dispatch, the unnamed stretch) have no one thread: unknown, with the reason
    assert c["phases"]["descriptor.prep"] == 0.0  # measured: no wait
    assert c["phases_unknown"] == {"decode.dispatch": cpusplit.DERIVED_NOTE}
    words = cpushare.cpu_words(ph.attrs["cpu"], "pull")
    assert words.startswith("**CPU wait:** 23 % of the handoff at the median request was threads waiting for a CPU")
    assert "(3 requests with CPU figures)" in words
    assert "Per phase, of its critical-path time: descriptor.prep 0.0 %, read.post 25 %, read.complete 29 %." in words
    assert f"({cpusplit.DERIVED_NOTE})" in words
    assert cpushare.cpu_words(ph.attrs["cpu"], "push") == "**CPU wait:** unknown (no completed handoff in this range)."


def test_a_derived_phase_takes_the_readings_before_its_end_as_kvlens_traces_does(tmp_path):
    """decode.dispatch (alloc -> descriptor.prep, 0.3 ms) from the worker
    thread's reading 0.4 ms before descriptor.prep: 3/4 of its 0.2 ms wait."""
    before = {
        sc.ATTR_CPU_BEFORE_AGE_S: [0.0004],
        sc.ATTR_CPU_BEFORE_ON_S: [0.0001],
        sc.ATTR_CPU_BEFORE_WAIT_S: [0.0002],
    }
    db = _pull_store(tmp_path, [1.0, 2.0, 4.0], before=before)
    c = data.phase_breakdown(db, None, None).attrs["cpu"]["pull"]
    assert c["phases"]["decode.dispatch"] == pytest.approx(0.00015 / 0.0003)
    assert "decode.dispatch" not in c["phases_unknown"]
    # the same split the trace model gives kvlens traces, request by request
    from kvtrace import store, tracemodel

    with store.reading(db) as conn:
        trs = tracemodel.slowest(conn, 10)
    shares = sorted(cpusplit.handoff_cpu(t).cpu_wait_s / t.handoff_s for t in trs)
    assert c["median"] == pytest.approx(shares[1]) and c["known"] == len(shares) == 3


def test_a_phase_without_figures_is_unknown_with_its_reason(tmp_path):
    db = _pull_store(tmp_path, [3.0, 3.0], unknown_post=True)
    c = data.phase_breakdown(db, None, None).attrs["cpu"]["pull"]
    assert "read.post" not in c["phases"]  # never a 0 share
    assert c["phases_unknown"]["read.post"] == "no reading of the thread at or before the phase's start"
    words = cpushare.cpu_words({"pull": c}, "pull")
    assert "Unknown: read.post (no reading of the thread at or before the phase's start)." in words


def test_no_figures_at_all_and_prometheus_say_unknown():
    none = {"pull": {"median": None, "known": 0, "unknown": {"turned off": 4}, "phases": {}, "phases_unknown": {}}}
    assert cpushare.cpu_words(none, "pull") == "**CPU wait:** unknown (turned off)."
    assert cpushare.cpu_words(None, "pull") == f"**CPU wait:** unknown ({cpushare.FROM_PROMETHEUS})."
    assert cpusplit.SPIN_NOTE in cpushare.HELP


def test_overview_shows_it_under_where_the_handoff_goes(app, store_path):  # noqa: F811
    """The fixture store predates CPU figures: each mode says unknown, with the reason."""
    at = app(store_path)
    no_exception(at)
    shown = [m.value for m in at.markdown if m.value.startswith("**CPU wait:**")]
    assert len(shown) == 2 and all(v.startswith("**CPU wait:** unknown (") for v in shown), shown
    assert "0 %" not in " ".join(shown)
