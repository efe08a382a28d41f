"""Recorder: trace-id derivation, bounded buffer, span building, fail-safety.

``memory_stays_under_cap`` is the hot-path budget (docs/architecture.md)."""

import socket
import threading
import time
import tracemalloc

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from exporters import pipeline
from kvtrace import store
from kvrecord import semconv as sc
from kvrecord.events import Event, Kind, as_event
from kvrecord.ids import base_request_id, root_span_id, trace_id_for
from kvrecord.recorder import Recorder

TID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def mem():
    exporter = InMemorySpanExporter()

    def factory(id_generator):
        p = TracerProvider(id_generator=id_generator)
        p.add_span_processor(SimpleSpanProcessor(exporter))
        return p

    return exporter, factory


def test_base_request_id_strips_vllm_suffix():
    assert base_request_id(f"cmpl-{TID}-0-1a2b3c4d") == f"cmpl-{TID}-0"
    assert base_request_id("plain") == "plain"


def test_trace_id_read_from_router_request_id_on_both_sides():
    p_id, d_id = f"cmpl-{TID}-0-deadbeef", f"cmpl-{TID}-0-0badf00d"
    assert trace_id_for(p_id) == trace_id_for(d_id) == int(TID, 16)


def test_trace_id_hashed_for_foreign_ids_and_suffix_insensitive():
    a, b = trace_id_for("cmpl-my-req-0-12345678"), trace_id_for("cmpl-my-req-0-87654321")
    assert a == b and a != 0 and a < 2**128
    assert trace_id_for("cmpl-other-0-12345678") != a


def test_root_span_id_deterministic_nonzero():
    assert root_span_id(int(TID, 16)) == root_span_id(int(TID, 16)) != 0


def test_spans_share_trace_and_parent_to_router_root(mem):
    exporter, factory = mem
    r = Recorder(role="prefill", mode="push", engine_id="p0", pipeline_factory=factory)
    router = Recorder(role="router", mode="push", pipeline_factory=factory)
    now = time.time_ns()
    r.record(sc.Phase.PREFILL_FINISHED, f"cmpl-{TID}-0-aaaaaaaa", now, now, "ok", {sc.ATTR_BLOCKS: 3})
    router.record_root(TID, None, now - 10, now + 10, "ok", {sc.ATTR_TTFT_S: 0.1})
    r.flush()
    router.flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, child = spans["request"], spans["prefill.finished"]
    assert root.context.trace_id == child.context.trace_id == int(TID, 16)
    assert root.parent is None
    assert child.parent.span_id == root.context.span_id == root_span_id(int(TID, 16))
    assert child.attributes[sc.ATTR_MODE] == "push" and child.attributes[sc.ATTR_ROLE] == "prefill"
    assert child.attributes[sc.ATTR_BLOCKS] == 3 and child.attributes[sc.ATTR_ENGINE_ID] == "p0"
    assert root.attributes[sc.ATTR_REQUEST_ID] == TID and root.attributes[sc.ATTR_TTFT_S] == 0.1
    assert not any(k.startswith("_") for k in root.attributes)


def test_incoming_traceparent_parents_the_root(mem):
    exporter, factory = mem
    router = Recorder(role="router", mode="pull", pipeline_factory=factory)
    t = time.time_ns()
    router.record_root(TID, 0x1234, t, t + 5)
    router.flush()
    (s,) = exporter.get_finished_spans()
    assert s.name == "request"
    assert s.parent.span_id == 0x1234 and s.context.trace_id == int(TID, 16)
    assert s.context.span_id == root_span_id(int(TID, 16))


def test_relay_recorded_by_trace_id_is_a_child_of_the_root(mem):
    exporter, factory = mem
    router = Recorder(role="router", mode="pull", pipeline_factory=factory)
    router.record(sc.Phase.RELAY, TID, 1, 2)
    router.flush()
    (s,) = exporter.get_finished_spans()
    assert s.context.trace_id == int(TID, 16) and s.parent.span_id == root_span_id(int(TID, 16))


def test_buffer_is_bounded_and_counts_drops():
    r = Recorder(role="decode", mode="pull", capacity=10, pipeline_factory=None)
    r._thread = object()  # keep the drain thread away: simulates a stalled exporter
    for i in range(25):
        r.record(sc.Phase.KV_READY, f"r{i}", 1, 1)
    r.record_root(TID, None, 1, 2)
    assert r.buffered == 10 and r.dropped == 16
    assert r.enqueue(r.take(3) * 2) == 3 and r.buffered == 10 and r.dropped == 19  # room for 3 of 6


def test_an_event_is_its_fields_in_event_order_until_read_by_name():
    """record/record_root buffer the plain tuple of an Event's fields (the
    hot path's cost); as_event gives the Event the span builder reads."""
    r = Recorder(role="prefill", mode="push", pipeline_factory=None)
    r._thread = object()  # nothing drains
    r.record(sc.Phase.KV_READY, "r1", 1, 2, "error", {sc.ATTR_BLOCKS: 3})
    r.point(sc.Phase.MATCH, "r2")
    r.record_root(TID, 0x1234, 5, 6)
    span, point, root = (as_event(f) for f in r.take(10))
    assert r.buffered == 0 and all(type(e) is Event for e in (span, point, root))
    assert span._asdict() == dict(
        kind=Kind.SPAN,
        phase=sc.Phase.KV_READY,
        request_id="r1",
        start_ns=1,
        end_ns=2,
        outcome="error",
        attrs={sc.ATTR_BLOCKS: 3},
        parent_span_id=None,
    )
    assert point.kind is Kind.SPAN and point.start_ns == point.end_ns > 0 and point.outcome == "ok"
    assert (root.kind, root.phase, root.request_id, root.parent_span_id) == (Kind.ROOT, sc.Phase.REQUEST, TID, 0x1234)


def test_unknown_outcome_and_role_map_to_other(mem):
    exporter, factory = mem
    r = Recorder(role="weird", mode="push", pipeline_factory=factory)
    r.record(sc.Phase.MATCH, "x", 1, 2, "banana")
    r.flush()
    (s,) = exporter.get_finished_spans()
    assert s.attributes[sc.ATTR_ROLE] == sc.OTHER and s.attributes[sc.ATTR_OUTCOME] == sc.OTHER


def test_failing_pipeline_never_raises_into_caller():
    def broken(id_generator):
        raise RuntimeError("exporter setup exploded")

    r = Recorder(role="prefill", mode="push", pipeline_factory=broken)
    r.record(sc.Phase.PREFILL_FINISHED, "a", 1, 2)
    r.flush()  # logs once, drops
    r.record(sc.Phase.PREFILL_FINISHED, "b", 1, 2)
    r.close()
    assert r.failed_dropped == 2  # both lost, and counted (reason export_failed)


def test_bad_event_is_skipped_others_exported(mem):
    exporter, factory = mem
    r = Recorder(role="prefill", mode="push", pipeline_factory=factory)
    r.record(sc.Phase.MATCH, None, 1, 2)  # a None request id cannot be hashed
    r.record_root(None, None, 1, 2)
    r.record(sc.Phase.MATCH, "good", 1, 2)
    r.record_root(TID, None, 1, 2)
    r.flush()
    assert [s.name for s in exporter.get_finished_spans()] == ["match", "request"]
    assert r.failed_dropped == 2 and r.exported == 2


def test_pinned_ids_apply_to_the_root_span_only(mem):
    exporter, factory = mem
    r = Recorder(role="router", mode="push", pipeline_factory=factory)
    r.record_root(TID, None, 1, 2)
    r.flush()
    p = r._provider
    other = p.get_tracer("t").start_span("other")  # the generator is back to random ids
    assert other.context.span_id != root_span_id(int(TID, 16))


def test_negative_interval_is_clamped(mem):
    exporter, factory = mem
    r = Recorder(role="prefill", mode="push", pipeline_factory=factory)
    r.record(sc.Phase.MATCH, "x", 100, 50)
    r.flush()
    (s,) = exporter.get_finished_spans()
    assert s.end_time >= s.start_time


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        Recorder(role="prefill", mode="push", capacity=0)


def test_memory_stays_under_cap_when_exporter_stalls():
    """64 MiB cap per process: a stalled drain thread leaves a full buffer, no more."""
    r = Recorder(role="prefill", mode="push", pipeline_factory=None)
    r._thread = object()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    attrs = {sc.ATTR_BLOCKS: 12, sc.ATTR_REMOTE_ENGINE_ID: "d0", sc.ATTR_REMOTE_RANK: 0}
    for i in range(200_000):
        r.record(sc.Phase.WRITE_POST, f"cmpl-{i:032x}-0-abcdef01", i, i + 1, "ok", dict(attrs))
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert r.dropped == 200_000 - r.capacity
    assert used < 64 * 2**20, used


def test_unreachable_otlp_endpoint_never_raises(tmp_path):
    """An OTLP collector that is down: spans still reach the store, nothing raises."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    cfg = {"kvlens_home": str(tmp_path), "otlp_endpoint": f"http://127.0.0.1:{port}", "kvlens_metrics": "off"}
    r = Recorder(
        role="decode",
        mode="pull",
        pipeline_factory=pipeline.provider_factory(role="decode", mode="pull", engine_id="d0", config=cfg),
    )
    r.record(sc.Phase.KV_READY, f"cmpl-{TID}-0-abcdef12", 1, 2)
    r.close()
    conn = store.connect(tmp_path / "traces.db", readonly=True)
    assert [s["name"] for s in store.spans_for(conn, [TID])[TID]] == ["kv.ready"]


def test_recorder_losses_reach_dropped_counts_by_reason():
    def broken(id_generator):
        raise RuntimeError("exporter setup exploded")

    # the in-process path (its pipeline factory is what breaks here); the sidecar path: tests/unit/test_sidecar.py
    r = pipeline.get_recorder(
        "decode",
        "push",
        "loss-reasons",
        {"kvlens_store": "off", "kvlens_metrics": "off", "kvlens_buffer_events": 2},
        span_builder="inline",
    )
    try:
        r._factory = broken
        before = pipeline.dropped_counts()
        r._thread = object()  # no drain thread: the buffer stays full
        for i in range(5):
            r.record(sc.Phase.KV_READY, f"r{i}", 1, 1)
        r._thread = None
        r.flush(timeout_s=1.0)  # builds the (broken) pipeline, drains: 2 events never become spans
        r._thread = threading.current_thread()  # (no drain thread; close does not join it)
        r._ready.clear()  # as if the pipeline were still being built at exit
        r.record(sc.Phase.KV_READY, "late", 1, 1)
        r.close(timeout_s=1.0)  # the buffered event is counted as shutdown
        after = pipeline.dropped_counts()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert delta[("decode", "buffer_full")] == 3
        assert delta[("decode", "export_failed")] == 2
        assert delta[("decode", "shutdown")] == 1
        assert r.recorded + r.dropped + r.shutdown_dropped == 6
    finally:
        pipeline._recorders.pop(next(k for k, v in pipeline._recorders.items() if v is r), None)


def test_close_is_bounded_when_the_exporter_hangs():
    """A provider whose flush and shutdown never return (an SDK exporter stuck on
    the network) cannot hold close past its bound... for providers that take a
    timeout; kvlens' own provider does (tests/unit/test_batching.py)."""
    from exporters.batching import BoundedTracerProvider, CountingBatchSpanProcessor, LossCounter

    class Stuck:
        def export(self, batch):
            time.sleep(30)

        def shutdown(self):
            time.sleep(30)

    built = []

    def factory(gen):
        p = BoundedTracerProvider(id_generator=gen, losses=LossCounter())
        p.add_span_processor(CountingBatchSpanProcessor(Stuck(), losses=p.losses, schedule_delay_s=0.05))
        built.append(p)
        return p

    r = Recorder(role="router", mode="push", pipeline_factory=factory).start()
    for i in range(10):
        r.record_root(f"{i + 1:032x}", None, 1, 2)
    time.sleep(0.3)
    t0 = time.monotonic()
    r.close(timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    assert built[0].losses.counts() == {"shutdown": 10}


def test_span_ids_do_not_follow_the_global_random_seed():
    """vLLM seeds the global ``random`` module alike in P's and D's processes;
    span ids drawn from it repeated across processes and two spans of one
    trace could collide (the store keeps one row per (trace, span id))."""
    import random

    from kvrecord.ids import PinnedIdGenerator

    draws = []
    for _ in range(2):  # two "processes" seeded the same way
        random.seed(1234)
        g = PinnedIdGenerator()
        draws.append([g.generate_span_id() for _ in range(50)])
    assert not set(draws[0]) & set(draws[1])
    assert all(0 < i < 2**64 for i in draws[0])
    with g.pin(span_id=7, trace_id=9):
        assert (g.generate_span_id(), g.generate_trace_id()) == (7, 9)
