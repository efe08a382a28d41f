"""Span-derived Prometheus metrics: labels, buckets, handoff from the store,
bounded cardinality, exemplars, and a processor that never raises."""

from __future__ import annotations

import os
import time

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as om_latest

from exporters import metrics as m
from exporters import pipeline
from kvtrace import store
from exporters.metrics import PhaseMetricsProcessor, metrics_app
from kvtrace.store import StoreSpanExporter, connect
from kvrecord import semconv as sc
from kvrecord.ids import PinnedIdGenerator
from kvrecord.recorder import Recorder

TID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def reg():
    return CollectorRegistry()


@pytest.fixture
def env(tmp_path, reg):
    """(registry, tracer, processor, store path): store processor first, as in pipeline.py."""
    db = tmp_path / "traces.db"
    proc = PhaseMetricsProcessor(reg, store_path=db, handoff_deadline_s=0.5, handoff_poll_s=0.02)
    provider = TracerProvider(id_generator=PinnedIdGenerator())
    provider.add_span_processor(SimpleSpanProcessor(StoreSpanExporter(db)))
    provider.add_span_processor(proc)
    yield reg, provider.get_tracer("t"), proc, db
    provider.shutdown()


def A(mode="push", role="prefill", **kw):
    d = {sc.ATTR_MODE: mode, sc.ATTR_ROLE: role}
    d.update(kw)
    return d


def emit(tracer, name, trace_hex=TID, dur_s=0.001, end_ns=None, attrs=None):
    end = end_ns or time.time_ns()
    ctx = otel_trace.set_span_in_context(NonRecordingSpan(SpanContext(int(trace_hex, 16), 0x1234, True, TraceFlags(1))))
    a = {sc.ATTR_OUTCOME: "ok"}
    a.update(attrs or {})
    s = tracer.start_span(name, context=ctx, attributes=a, start_time=end - int(dur_s * 1e9))
    s.end(end_time=end)


MS = 1_000_000


def crossings(tr, mode, pf, kv_true, trace_hex=TID, d_shift=0):
    """The messages of one request that cross between P and D (they bound the
    clocks, docs/phases.md): times are true times, D's read ``d_shift`` ahead."""

    def d(name, t0, t1):
        emit(tr, name, trace_hex, end_ns=t1 + d_shift, dur_s=(t1 - t0) / 1e9, attrs=A(mode, "decode"))

    def p(name, t0, t1):
        emit(tr, name, trace_hex, end_ns=t1, dur_s=(t1 - t0) / 1e9, attrs=A(mode, "prefill"))

    if mode == "push":
        d("registration.send", pf - 3 * MS, pf - 2 * MS - MS // 2)
        p("registration.receive", pf - 2 * MS, pf - 2 * MS)
        p("write.post", pf + MS // 2, pf + MS)
    else:
        d("alloc", pf + MS, pf + MS)
        d("read.post", pf + 2 * MS, pf + 2 * MS + MS // 2)
        p("kv.released", kv_true, kv_true)


def val(reg, name, **labels):
    return reg.get_sample_value(name, labels)


def series_count(reg) -> int:
    return sum(len(mf.samples) for mf in reg.collect())


# --------------------------------------------------------------- phases
def test_phase_histogram_labels_and_value(env):
    reg, tr, _, _ = env
    emit(tr, "write.post", dur_s=0.003, attrs=A("push", "prefill"))
    emit(tr, "write.post", dur_s=0.2, attrs=A("push", "prefill"))
    emit(tr, "read.post", dur_s=0.004, attrs=A("pull", "decode"))
    lab = dict(mode="push", role="prefill", phase="write.post", outcome="ok")
    assert val(reg, "kvlens_phase_duration_seconds_count", **lab) == 2
    assert val(reg, "kvlens_phase_duration_seconds_sum", **lab) == pytest.approx(0.203)
    assert val(reg, "kvlens_phase_duration_seconds_bucket", le="0.005", **lab) == 1
    assert (
        val(reg, "kvlens_phase_duration_seconds_count", mode="pull", role="decode", phase="read.post", outcome="ok")
        == 1
    )


def test_unknown_label_values_map_to_other(env):
    reg, tr, _, _ = env
    emit(tr, "mystery.phase", attrs={sc.ATTR_MODE: "sideways", sc.ATTR_ROLE: "janitor", sc.ATTR_OUTCOME: "meh"})
    emit(tr, "match", attrs={sc.ATTR_MODE: ["not", "hashable"]})  # no role at all
    assert (
        val(reg, "kvlens_phase_duration_seconds_count", mode="_OTHER", role="_OTHER", phase="_OTHER", outcome="_OTHER")
        == 1
    )
    assert (
        val(reg, "kvlens_phase_duration_seconds_count", mode="_OTHER", role="_OTHER", phase="match", outcome="ok") == 1
    )


def test_enum_members_as_attribute_values_are_accepted(env):
    reg, tr, _, _ = env
    emit(tr, sc.Phase.ALLOC.value, attrs={sc.ATTR_MODE: sc.Mode.PULL, sc.ATTR_ROLE: sc.Role.DECODE})
    assert val(reg, "kvlens_phase_duration_seconds_count", mode="pull", role="decode", phase="alloc", outcome="ok") == 1


# ---------------------------------------------------------- router metrics
def test_request_span_gives_ttft_and_request_counter(env):
    reg, tr, _, _ = env
    emit(tr, "request", attrs=A("push", "router", **{sc.ATTR_TTFT_S: 0.12, sc.ATTR_DISPATCH: "overlapped"}))
    emit(
        tr,
        "request",
        "1" * 32,
        attrs=A("push", "router", **{sc.ATTR_OUTCOME: "failed", sc.ATTR_DISPATCH: "overlapped"}),
    )
    emit(tr, "request", "2" * 32, attrs=A("pull", "router", **{sc.ATTR_TTFT_S: 0.3, sc.ATTR_DISPATCH: "x"}))
    assert val(reg, "kvlens_ttft_seconds_count", mode="push", dispatch="overlapped") == 1
    assert val(reg, "kvlens_ttft_seconds_sum", mode="push", dispatch="overlapped") == pytest.approx(0.12)
    assert val(reg, "kvlens_ttft_seconds_count", mode="pull", dispatch="_OTHER") == 1
    assert val(reg, "kvlens_requests_total", mode="push", outcome="ok") == 1
    assert val(reg, "kvlens_requests_total", mode="push", outcome="failed") == 1
    assert val(reg, "kvlens_requests_total", mode="pull", outcome="ok") == 1


def test_request_span_gives_tpot_by_mode(env):
    """The root span's client-seen TPOT, by mode (vLLM's TPOT has no mode label: issue 43);
    a request without one (all its tokens in one read) is not observed as 0."""
    reg, tr, _, _ = env
    emit(tr, "request", "3" * 32, attrs=A("push", "router", **{sc.ATTR_TPOT_S: 0.007}))
    emit(tr, "request", "4" * 32, attrs=A("push", "router", **{sc.ATTR_TPOT_S: 0.009}))
    emit(tr, "request", "5" * 32, attrs=A("pull", "router", **{sc.ATTR_TPOT_S: 0.0104}))
    emit(tr, "request", "6" * 32, attrs=A("pull", "router"))  # untimed
    assert val(reg, "kvlens_tpot_seconds_count", mode="push") == 2
    assert val(reg, "kvlens_tpot_seconds_sum", mode="push") == pytest.approx(0.016)
    assert val(reg, "kvlens_tpot_seconds_count", mode="pull") == 1
    assert val(reg, "kvlens_tpot_seconds_sum", mode="pull") == pytest.approx(0.0104)
    assert val(reg, "kvlens_requests_total", mode="pull", outcome="ok") == 2


# ------------------------------------------------------------- transfers
def test_transfer_bytes_and_descriptors(env):
    reg, tr, _, _ = env
    emit(tr, "write.complete", attrs=A("push", "prefill", **{sc.ATTR_BYTES: 1 << 20, sc.ATTR_DESCRIPTORS: 48}))
    emit(tr, "read.complete", attrs=A("pull", "decode", **{sc.ATTR_BYTES: 5000, sc.ATTR_DESCRIPTORS: 3}))
    emit(tr, "read.complete", attrs=A("pull", "decode", **{sc.ATTR_BYTES: 0, sc.ATTR_DESCRIPTORS: "many"}))
    assert val(reg, "kvlens_transfer_bytes_sum", mode="push", role="prefill") == 1 << 20
    assert val(reg, "kvlens_transfer_descriptors_bucket", mode="push", role="prefill", le="64.0") == 1
    assert val(reg, "kvlens_transfer_descriptors_bucket", mode="push", role="prefill", le="32.0") == 0
    # 0 bytes (NIXL telemetry off) and non-numeric counts are not observed
    assert val(reg, "kvlens_transfer_bytes_count", mode="pull", role="decode") == 1
    assert val(reg, "kvlens_transfer_descriptors_count", mode="pull", role="decode") == 1


# ---------------------------------------------------------- push gauges
def test_push_waiting_gauges_follow_registration_and_match(env):
    reg, tr, _, _ = env
    g = lambda: (val(reg, "kvlens_push_registrations_waiting"), val(reg, "kvlens_push_prefills_waiting"))  # noqa: E731
    emit(tr, "registration.receive", "a" * 32, attrs=A())  # D registered first
    assert g() == (1, 0)
    emit(tr, "prefill.finished", "a" * 32, attrs=A())
    assert g() == (1, 1)
    emit(tr, "match", "a" * 32, attrs=A(**{sc.ATTR_MATCH_FIRST: "registration"}))
    assert g() == (0, 0)
    emit(tr, "prefill.finished", "b" * 32, attrs=A())  # prefill first
    emit(tr, "prefill.finished", "c" * 32, attrs=A())
    emit(tr, "prefill.finished", "d" * 32, attrs=A(**{sc.ATTR_OUTCOME: "failed"}))  # nothing to send
    assert g() == (0, 2)
    emit(tr, "registration.receive", "b" * 32, attrs=A())
    emit(tr, "match", "b" * 32, attrs=A(**{sc.ATTR_MATCH_FIRST: "prefill"}))
    assert g() == (0, 1)
    emit(tr, "write.complete", "c" * 32, attrs=A(**{sc.ATTR_OUTCOME: "expired"}))  # lease reaped
    assert g() == (0, 0)
    emit(tr, "prefill.finished", "e" * 32, attrs=A("pull"))  # pull never counts
    assert g() == (0, 0)


# ------------------------------------------------------------- handoff
def test_handoff_read_from_store_when_request_ends(env):
    reg, tr, proc, _ = env
    t = time.time_ns()
    emit(tr, "prefill.finished", end_ns=t, dur_s=0, attrs=A("push", "prefill"))
    crossings(tr, "push", t, t + 7_000_000)
    emit(tr, "kv.ready", end_ns=t + 7_000_000, dur_s=0, attrs=A("push", "decode"))
    emit(tr, "request", end_ns=t + 9_000_000, attrs=A("push", "router", **{sc.ATTR_TTFT_S: 0.02}))
    assert proc.force_flush(5000)
    assert val(reg, "kvlens_handoff_seconds_count", mode="push") == 1
    assert val(reg, "kvlens_handoff_seconds_sum", mode="push") == pytest.approx(0.007)
    text = om_latest(reg).decode()
    line = next(x for x in text.splitlines() if x.startswith('kvlens_handoff_seconds_bucket{le="0.01",mode="push"}'))
    assert f'# {{trace_id="{TID}"}} 0.007' in line


def test_handoff_waits_for_late_spans_and_gives_up_when_missing(env):
    reg, tr, proc, _ = env
    t = time.time_ns()
    # router finishes first; P's and D's spans land in the store a bit later
    emit(tr, "request", "a" * 32, end_ns=t, attrs=A("pull", "router"))
    emit(tr, "request", "b" * 32, end_ns=t, attrs=A("pull", "router", **{sc.ATTR_OUTCOME: "failed"}))
    proc.handoff.resolve_once()
    assert proc.handoff.pending() == 2
    emit(tr, "prefill.finished", "a" * 32, end_ns=t - 5_000_000, dur_s=0, attrs=A("pull", "prefill"))
    crossings(tr, "pull", t - 5_000_000, t - 1_000_000, "a" * 32)
    emit(tr, "kv.ready", "a" * 32, end_ns=t - 1_000_000, dur_s=0, attrs=A("pull", "decode"))
    emit(tr, "prefill.finished", "b" * 32, end_ns=t, dur_s=0, attrs=A("pull", "prefill"))  # D never ready
    proc.force_flush(3000)
    assert proc.handoff.pending() == 0
    assert val(reg, "kvlens_handoff_seconds_count", mode="pull") == 1
    assert val(reg, "kvlens_handoff_seconds_sum", mode="pull") == pytest.approx(0.004)
    assert val(reg, "kvlens_handoff_unresolved_total", mode="pull", reason="missing") == 1


def test_handoff_queue_is_bounded(tmp_path, reg):
    proc = PhaseMetricsProcessor(
        reg, store_path=tmp_path / "none.db", handoff_max_pending=3, handoff_deadline_s=0.1, handoff_poll_s=0.02
    )
    provider = TracerProvider()
    provider.add_span_processor(proc)
    tr = provider.get_tracer("t")
    for i in range(5):
        emit(tr, "request", f"{i + 1:032x}", attrs=A("push", "router"))
    assert proc.handoff.pending() == 3
    assert val(reg, "kvlens_handoff_unresolved_total", mode="push", reason="overflow") == 2
    proc.force_flush(2000)
    assert val(reg, "kvlens_handoff_unresolved_total", mode="push", reason="no_store") == 3
    provider.shutdown()


def test_handoff_count_reconciles_with_store_through_recorders(tmp_path, reg):
    """Router, P and D recorders (real trace ids from request ids) -> store + metrics:
    per mode, handoff count == store traces with handoff_s; + unresolved == requests."""
    db = tmp_path / "traces.db"
    # a deadline the slowest store write on a busy machine stays under: with 1 s a resolved
    # handoff was sometimes counted missing (its P/D spans landed after the deadline)
    proc = PhaseMetricsProcessor(reg, store_path=db, handoff_deadline_s=8.0, handoff_poll_s=0.02)

    def factory(id_generator):
        p = TracerProvider(id_generator=id_generator)
        p.add_span_processor(SimpleSpanProcessor(StoreSpanExporter(db)))
        p.add_span_processor(proc)
        return p

    recs = {
        (role, mode): Recorder(role=role, mode=mode, pipeline_factory=factory)
        for role in ("router", "prefill", "decode")
        for mode in ("push", "pull")
    }
    expected = {"push": 0, "pull": 0}
    for i in range(40):
        mode = "push" if i % 2 else "pull"
        tid = f"{i + 1:032x}"
        t = time.time_ns()
        recs["prefill", mode].record(sc.Phase.PREFILL_FINISHED, f"cmpl-{tid}-0-aaaaaaaa", t, t)
        # one message each way between P and D (bounds the clocks)
        recs["decode", mode].record(sc.Phase.REGISTRATION_SEND, f"cmpl-{tid}-0-bbbbbbbb", t - 900, t - 800)
        recs["prefill", mode].record(sc.Phase.REGISTRATION_RECEIVE, f"cmpl-{tid}-0-aaaaaaaa", t - 500, t - 500)
        recs["prefill", mode].record(sc.Phase.WRITE_POST, f"cmpl-{tid}-0-aaaaaaaa", t + 100, t + 200)
        if i % 5:  # every fifth request never reaches kv.ready
            recs["decode", mode].record(sc.Phase.KV_READY, f"cmpl-{tid}-0-bbbbbbbb", t + 2000, t + 2000 + i)
            expected[mode] += 1
        recs["router", mode].record_root(tid, None, t - 1000, t + 10_000, "ok", {sc.ATTR_TTFT_S: 0.01})
    for r in recs.values():
        r.flush()
    assert proc.force_flush(60_000)  # the requests without kv.ready wait out the deadline
    conn = connect(db, readonly=True)
    for mode in ("push", "pull"):
        n_store = len(store.slowest(conn, 1000, mode=mode, completed=True))
        assert n_store == expected[mode]
        assert val(reg, "kvlens_handoff_seconds_count", mode=mode) == n_store
        assert (
            val(reg, "kvlens_handoff_seconds_count", mode=mode)
            + val(reg, "kvlens_handoff_unresolved_total", mode=mode, reason="missing")
            == val(reg, "kvlens_requests_total", mode=mode, outcome="ok")
            == 20
        )
    conn.close()
    for r in recs.values():
        r._provider = None  # shared processor: shut down once below
        r.close()
    proc.shutdown()


def test_handoff_from_decode_trigger(tmp_path, reg):
    db = tmp_path / "traces.db"
    proc = PhaseMetricsProcessor(reg, store_path=db, handoff_from="decode", handoff_poll_s=0.02)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(StoreSpanExporter(db)))
    provider.add_span_processor(proc)
    tr = provider.get_tracer("t")
    t = time.time_ns()
    emit(tr, "prefill.finished", end_ns=t, dur_s=0, attrs=A("push", "prefill"))
    crossings(tr, "push", t, t + 3_000_000)
    emit(tr, "kv.ready", end_ns=t + 3_000_000, dur_s=0, attrs=A("push", "decode"))
    emit(tr, "request", end_ns=t + 4_000_000, attrs=A("push", "router"))  # not a trigger now
    proc.force_flush(3000)
    assert val(reg, "kvlens_handoff_seconds_count", mode="push") == 1
    provider.shutdown()


@pytest.mark.parametrize("mode, shift_ms", [("push", 250), ("pull", -250)])
def test_handoff_is_corrected_for_a_shifted_d_clock(env, mode, shift_ms):
    """D's wall clock shifted: the observed handoff is the true one to within
    the stated bound, and the offset's interval (gauges) contains the shift."""
    reg, tr, proc, db = env
    t = time.time_ns()
    shift = shift_ms * MS
    emit(tr, "prefill.finished", end_ns=t, dur_s=0, attrs=A(mode, "prefill", **{sc.ATTR_ENGINE_ID: "p0"}))
    crossings(tr, mode, t, t + 6 * MS, d_shift=shift)
    emit(tr, "kv.ready", end_ns=t + 6 * MS + shift, dur_s=0, attrs=A(mode, "decode", **{sc.ATTR_ENGINE_ID: "d0"}))
    emit(tr, "request", end_ns=t + 9 * MS, attrs=A(mode, "router"))
    assert proc.force_flush(5000)
    got = val(reg, "kvlens_handoff_seconds_sum", mode=mode)
    with store.reading(db) as c:
        row = store.handoffs(c, [TID])[TID]
    assert abs(got - 0.006) <= row["handoff_err_s"] + 1e-9 and row["handoff_err_s"] < abs(shift_ms) / 1e3
    off = val(reg, "kvlens_clock_offset_seconds", p_engine="p0", d_engine="d0")
    width = val(reg, "kvlens_clock_offset_width_seconds", p_engine="p0", d_engine="d0")
    assert off - width / 2 - 1e-9 <= shift / 1e9 <= off + width / 2 + 1e-9


def test_handoff_without_a_d_to_p_message_is_unknown_not_clamped(env):
    reg, tr, proc, _ = env
    t = time.time_ns()
    emit(tr, "prefill.finished", end_ns=t, dur_s=0, attrs=A("push", "prefill"))
    emit(tr, "kv.ready", end_ns=t - 2 * MS, dur_s=0, attrs=A("push", "decode"))  # D's clock behind
    emit(tr, "request", end_ns=t + MS, attrs=A("push", "router"))
    proc.force_flush(3000)
    assert val(reg, "kvlens_handoff_seconds_count", mode="push") is None
    assert val(reg, "kvlens_handoff_unresolved_total", mode="push", reason="clock_unknown") == 1


def test_bad_configuration_raises_at_construction(reg):
    with pytest.raises(ValueError, match="handoff_from"):
        PhaseMetricsProcessor(reg, handoff_from="somewhere")
    with pytest.raises(ValueError, match="max_pending"):
        PhaseMetricsProcessor(reg, handoff_max_pending=0)


# ------------------------------------------------------- cardinality, safety
def test_ten_thousand_request_ids_add_no_series(reg):
    provider = TracerProvider()  # metrics only: this test is about label cardinality
    provider.add_span_processor(PhaseMetricsProcessor(reg, handoff_from="off"))
    tr = provider.get_tracer("t")
    for i in range(10):
        emit(
            tr,
            "write.complete",
            f"{i + 1:032x}",
            attrs=A(**{sc.ATTR_REQUEST_ID: f"cmpl-{i}", sc.ATTR_BYTES: 4096, sc.ATTR_DESCRIPTORS: 2}),
        )
    before = series_count(reg)
    for i in range(10_000):
        emit(
            tr,
            "write.complete",
            f"{i + 100:032x}",
            attrs=A(**{sc.ATTR_REQUEST_ID: f"cmpl-{i}-0-deadbeef", sc.ATTR_BYTES: 4096 + i, sc.ATTR_DESCRIPTORS: 2}),
        )
    assert series_count(reg) == before
    assert (
        val(
            reg,
            "kvlens_phase_duration_seconds_count",
            mode="push",
            role="prefill",
            phase="write.complete",
            outcome="ok",
        )
        == 10_010
    )
    assert sum(len(c) for c in m.families_for(reg).children.values()) < 20


class _Garbage:
    name = None
    start_time = 5
    end_time = 10
    context = None
    attributes = {sc.ATTR_MODE: object()}


def test_processor_never_raises_on_garbage_spans(reg, caplog):
    proc = PhaseMetricsProcessor(reg)
    for bad in (None, object(), _Garbage(), 42, "span"):
        proc.on_end(bad)
    proc.on_start(None)
    assert proc.force_flush(100)
    proc.shutdown()


def test_failing_dropped_source_leaves_metrics_working(env):
    reg, tr, proc, _ = env

    def boom():
        raise RuntimeError("no")

    m.set_dropped_source(boom)
    try:
        proc._next_drop_check = 0
        emit(tr, "alloc", attrs=A("pull", "decode"))
        assert (
            val(reg, "kvlens_phase_duration_seconds_count", mode="pull", role="decode", phase="alloc", outcome="ok")
            == 1
        )
    finally:
        m.set_dropped_source(None)


def test_dropped_counter_tracks_recorder_drops(reg):
    proc = PhaseMetricsProcessor(reg, handoff_from="off")
    drops = {"prefill": 0}
    m.set_dropped_source(lambda: dict(drops))
    try:
        drops["prefill"] = 3
        proc.sync_dropped()
        drops["prefill"] = 10
        proc.sync_dropped()
        proc.sync_dropped()
        # a role -> total source (the pre-reason shape) counts as reason buffer_full
        assert val(reg, "kvlens_telemetry_dropped_total", role="prefill", reason="buffer_full") == 10
    finally:
        m.set_dropped_source(None)


def test_dropped_counter_by_role_and_reason(reg):
    proc = PhaseMetricsProcessor(reg, handoff_from="off")
    drops = {
        ("decode", "store"): 4,
        ("decode", "queue_full"): 1,
        ("router", "shutdown"): 2,
        ("decode", "bogus-reason"): 3,
        ("bogus-role", "export_failed"): 5,
    }
    m.set_dropped_source(lambda: dict(drops))
    try:
        proc.sync_dropped()
        drops[("decode", "store")] = 9
        proc.sync_dropped()
        assert val(reg, "kvlens_telemetry_dropped_total", role="decode", reason="store") == 9
        assert val(reg, "kvlens_telemetry_dropped_total", role="decode", reason="queue_full") == 1
        assert val(reg, "kvlens_telemetry_dropped_total", role="router", reason="shutdown") == 2
        # labels stay closed sets
        assert val(reg, "kvlens_telemetry_dropped_total", role="decode", reason="_OTHER") == 3
        assert val(reg, "kvlens_telemetry_dropped_total", role="_OTHER", reason="export_failed") == 5
    finally:
        m.set_dropped_source(None)


def test_metrics_shutdown_publishes_the_last_losses(reg):
    """Losses counted at shutdown reach the counter even when no span ends after them."""
    drops = {("prefill", "shutdown"): 0}
    proc = PhaseMetricsProcessor(reg, handoff_from="off", dropped_source=lambda: dict(drops))
    proc.sync_dropped()
    drops[("prefill", "shutdown")] = 7
    proc.shutdown()
    assert val(reg, "kvlens_telemetry_dropped_total", role="prefill", reason="shutdown") == 7


def test_pipeline_dropped_source_reads_recorders(reg, tmp_path):
    r = pipeline.get_recorder(
        "decode", "pull", "dropper-test", {"kvlens_store": "off", "kvlens_metrics": "off", "kvlens_buffer_events": 1}
    )
    try:
        key = ("decode", "buffer_full")
        before = pipeline.dropped_counts().get(key, 0)
        r._thread = object()  # keep the buffer full: no drain thread
        r.record(sc.Phase.ALLOC, "x", 1, 1)
        r.record(sc.Phase.ALLOC, "y", 1, 1)
        r.record(sc.Phase.ALLOC, "z", 1, 1)
        assert pipeline.dropped_counts()[key] == before + 2
        proc = PhaseMetricsProcessor(reg, handoff_from="off", dropped_source=pipeline.dropped_counts)
        proc.sync_dropped()
        assert val(reg, "kvlens_telemetry_dropped_total", role="decode", reason="buffer_full") >= 2
    finally:
        pipeline._recorders.pop(next(k for k, v in pipeline._recorders.items() if v is r), None)


def test_pipeline_gives_its_metrics_processor_the_recorders_drop_counts(tmp_path):
    build = pipeline.provider_factory(
        role="decode", mode="pull", engine_id="d0", config={"kvlens_home": str(tmp_path), "kvlens_store": "off"}
    )
    provider = build(PinnedIdGenerator())
    try:
        (proc,) = [p for p in provider._active_span_processor._span_processors if isinstance(p, PhaseMetricsProcessor)]
        assert proc._dropped_source is pipeline.dropped_counts
        assert proc.handoff.location.path == tmp_path.resolve() / "traces.db"
    finally:
        provider.shutdown()


def test_two_processors_share_one_registry(reg):
    a = PhaseMetricsProcessor(reg, handoff_from="off")
    b = PhaseMetricsProcessor(reg, handoff_from="off")  # no "Duplicated timeseries"
    assert a.fam is b.fam


# ------------------------------------------------------------- exposition
def test_exemplar_in_openmetrics_exposition(env):
    reg, tr, _, _ = env
    emit(tr, "descriptor.prep", dur_s=0.0002, attrs=A())
    text = om_latest(reg).decode()
    assert f'# {{trace_id="{TID}"}}' in text
    assert text.rstrip().endswith("# EOF")


def test_exemplars_off_in_multiprocess_mode(monkeypatch, reg):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent")
    assert PhaseMetricsProcessor(reg, handoff_from="off").exemplars is False


def test_metrics_app_negotiates_openmetrics(env):
    import asyncio

    import httpx

    reg, tr, _, _ = env
    emit(tr, "handshake", dur_s=0.5, attrs=A("pull", "decode"))
    app = metrics_app(reg)

    async def get(accept):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/", headers={"accept": accept})

    om = asyncio.run(get("application/openmetrics-text; version=1.0.0"))
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert f'trace_id="{TID}"' in om.text
    plain = asyncio.run(get("text/plain"))
    assert "kvlens_phase_duration_seconds_bucket" in plain.text and "trace_id" not in plain.text


def test_multiprocess_mode_like_vllm(tmp_path):
    """With PROMETHEUS_MULTIPROC_DIR set (as vLLM does), a worker process's
    metrics on the default REGISTRY reach a MultiProcessCollector in another
    process; gauges sum across processes (livesum); no exemplars."""
    import subprocess
    import sys
    import textwrap

    mp = tmp_path / "mp"
    mp.mkdir()
    worker = textwrap.dedent("""
        import time
        from opentelemetry.sdk.trace import TracerProvider
        from exporters.metrics import PhaseMetricsProcessor
        p = TracerProvider(); proc = PhaseMetricsProcessor(handoff_from="off"); p.add_span_processor(proc)
        assert proc.exemplars is False
        t = p.get_tracer("w")
        attrs = {"kvlens.mode": "push", "kvlens.role": "prefill", "kvlens.outcome": "ok"}
        for name in ("write.post", "prefill.finished", "registration.receive"):
            t.start_span(name, attributes=attrs, start_time=1_000_000).end(end_time=3_000_000)
    """)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp))
    for _ in range(2):  # two worker processes of one instance
        subprocess.run([sys.executable, "-c", worker], env=env, check=True, timeout=60)
    server = textwrap.dedent("""
        from prometheus_client import CollectorRegistry, multiprocess, generate_latest
        r = CollectorRegistry(); multiprocess.MultiProcessCollector(r)
        print(generate_latest(r).decode())
    """)
    out = subprocess.run(
        [sys.executable, "-c", server], env=env, check=True, timeout=60, capture_output=True, text=True
    ).stdout
    assert 'kvlens_phase_duration_seconds_count{mode="push",outcome="ok",phase="write.post",role="prefill"} 2.0' in out
    assert "kvlens_push_prefills_waiting 2.0" in out  # livesum; dead workers kept: not marked dead
    assert "trace_id" not in out


def test_dashboard_reads_dropped_telemetry_by_reason():
    from dashboard import prom

    asked = []

    def q(expr):
        asked.append(expr)
        return [({"reason": "store"}, 12.0), ({"reason": "queue_full"}, 3.0), ({"reason": "shutdown"}, 0.0)]

    total, by = prom._dropped(q, "15m")
    assert total == 15 and by == {"store": 12.0, "queue_full": 3.0}
    assert asked == ["sum by (reason) (increase(kvlens_telemetry_dropped_total[15m]))"]
    assert prom._dropped(lambda e: [], "5m") == (None, {})  # no series: n/a, not 0


def test_dropped_counter_reads_zero_before_the_first_loss(reg):
    """Every reason of a recording role is a series at 0 once its processor
    syncs, so Prometheus (and the dashboard's lost-spans card) reads 0, not
    "no data", when nothing was lost; a loss then counts from there."""
    from kvrecord.recorder import DropReason

    r = pipeline.get_recorder(
        "prefill", "push", "zero-drops", {"kvlens_store": "off", "kvlens_metrics": "off", "kvlens_buffer_events": 1}
    )
    try:
        counts = pipeline.dropped_counts()
        assert {("prefill", x.value) for x in DropReason} <= set(counts)
        proc = PhaseMetricsProcessor(reg, handoff_from="off", dropped_source=pipeline.dropped_counts)
        proc.sync_dropped()
        for reason in DropReason:
            assert (
                val(reg, "kvlens_telemetry_dropped_total", role="prefill", reason=reason.value)
                == counts[("prefill", reason.value)]
            )
        before = counts[("prefill", "buffer_full")]
        r._thread = object()  # keep the buffer full: no drain thread
        r.record(sc.Phase.ALLOC, "x", 1, 1)
        r.record(sc.Phase.ALLOC, "y", 1, 1)
        proc.sync_dropped()
        assert val(reg, "kvlens_telemetry_dropped_total", role="prefill", reason="buffer_full") == before + 1
    finally:
        pipeline._recorders.pop(next(k for k, v in pipeline._recorders.items() if v is r), None)
