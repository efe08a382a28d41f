"""``kvlens collect``: OTLP decoding (protobuf from the real SDK encoder,
OTLP-JSON) into the SDK's own ReadableSpan, so the store and the metrics
processor take a span from another host exactly like a local one, bad input over HTTP, back-pressure and drop counting,
and the real command fed by the SDK's OTLP/HTTP exporter. Real components
throughout: the SDK, the store, prometheus_client, Starlette, uvicorn."""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest
from fastapi import FastAPI
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from kvtrace import store
from collector import otlp, wire
from collector.app import INLINE_DECODE_BYTES, create_app, mount_receiver
from collector.ingest import Ingest, collector_ingest
from exporters.metrics import PhaseMetricsProcessor
from kvtrace.store.schema import write_tx
from fakes import wait_for
from kvrecord import semconv as sc
from kvrecord.recorder import Recorder

PB = {"content-type": "application/x-protobuf"}
JS = {"content-type": "application/json"}
MS = 1_000_000
P = sc.Phase


# ----------------------------------------------------------------- spans
def _factory(exporter, role: str, engine: str | None):
    """The provider pipeline.py builds (same resource), exporting to memory."""

    def build(id_generator):
        attrs = {"service.name": f"kvlens-{role}", "kvlens.role": role}
        if engine:
            attrs["service.instance.id"] = engine
        tp = TracerProvider(resource=Resource.create(attrs), id_generator=id_generator)
        tp.add_span_processor(SimpleSpanProcessor(exporter))
        return tp

    return build


def _request(recs, mode: str, tid: str, t0: int) -> None:
    """One request's spans as router, P and D record them (instrumented_connector)."""
    router, pre, dec = recs[("router", mode)], recs[("prefill", mode)], recs[("decode", mode)]
    p_rid, d_rid = f"cmpl-{tid}-0-{secrets.token_hex(4)}", f"cmpl-{tid}-0-{secrets.token_hex(4)}"
    kv = {sc.ATTR_BLOCKS: 8, sc.ATTR_BYTES: 8 * 131072, sc.ATTR_DESCRIPTORS: 32, sc.ATTR_REMOTE_RANK: 0}
    pf = t0 + 30 * MS
    pre.record(P.PREFILL, p_rid, t0 + MS, pf, "ok", {sc.ATTR_TOKENS: 512})
    pre.record(P.PREFILL_FINISHED, p_rid, pf, pf, "ok", {sc.ATTR_BLOCKS: 8})
    if mode == "push":
        dec.record(P.REGISTRATION_STAGE, d_rid, t0 + 2 * MS, t0 + 2 * MS, "ok", {sc.ATTR_BLOCKS: 8})
        dec.record(P.REGISTRATION_SEND, d_rid, t0 + 2 * MS, t0 + 3 * MS, "ok", {sc.ATTR_REMOTE_ENGINE_ID: "p0"})
        pre.record(P.REGISTRATION_RECEIVE, p_rid, t0 + 4 * MS, t0 + 4 * MS, "ok", {sc.ATTR_REMOTE_ENGINE_ID: "d0"})
        pre.record(P.MATCH, p_rid, t0 + 4 * MS, pf, "ok", {sc.ATTR_MATCH_FIRST: "registration"})
        pre.record(P.HANDSHAKE, p_rid, pf, pf + MS, "ok", {sc.ATTR_REMOTE_ENGINE_ID: "d0", sc.ATTR_DEFERRED: True})
        pre.record(P.DESCRIPTOR_PREP, p_rid, pf + MS, pf + 2 * MS, "ok", kv)
        pre.record(P.WRITE_POST, p_rid, pf + 2 * MS, pf + 3 * MS, "ok", kv)
        pre.record(P.WRITE_COMPLETE, p_rid, pf + 3 * MS, pf + 6 * MS, "ok", {**kv, sc.ATTR_NIXL_XFER_S: 0.0025})
    else:
        router.record(P.RELAY, tid, pf + MS, pf + 2 * MS, "ok")
        dec.record(P.ALLOC, d_rid, pf + 3 * MS, pf + 3 * MS, "ok", {sc.ATTR_BLOCKS: 8})
        dec.record(P.DESCRIPTOR_PREP, d_rid, pf + 3 * MS, pf + 4 * MS, "ok", kv)
        dec.record(P.READ_POST, d_rid, pf + 4 * MS, pf + 5 * MS, "ok", kv)
        dec.record(
            P.READ_COMPLETE,
            d_rid,
            pf + 5 * MS,
            pf + 8 * MS,
            "failed",
            {**kv, sc.ATTR_NIXL_XFER_S: 0.003, sc.ATTR_ERROR: "NIXL_ERR_REMOTE_DISCONNECT"},
        )
    dec.record(P.KV_READY, d_rid, pf + 9 * MS, pf + 9 * MS, "ok", {sc.ATTR_BLOCKS: 8})
    router.record_root(
        tid,
        None,
        t0,
        pf + 40 * MS,
        "ok",
        {
            sc.ATTR_TTFT_S: 0.045,
            sc.ATTR_DISPATCH: "overlapped" if mode == "push" else "sequential",
            sc.ATTR_STATUS_CODE: 200,
        },
    )


def record_spans(n_per_mode: int = 2) -> list:
    """Finished SDK spans (ReadableSpan) of push and pull requests, recorded
    by real Recorders with the resource each kvlens process has."""
    exporter = InMemorySpanExporter()
    engines = {"router": None, "prefill": "p0", "decode": "d0"}
    recs = {
        (r, m): Recorder(role=r, mode=m, engine_id=e, pipeline_factory=_factory(exporter, r, e))
        for r, e in engines.items()
        for m in ("push", "pull")
    }
    t0 = time.time_ns() - 10**9
    for i in range(n_per_mode):
        for mode in ("push", "pull"):
            _request(recs, mode, secrets.token_hex(16), t0 + i * 100 * MS)
    for r in recs.values():
        r.flush()
    spans = list(exporter.get_finished_spans())
    for r in recs.values():
        r.close()
    return spans


@pytest.fixture(scope="module")
def sdk_spans():
    return record_spans()


def pb_body(spans) -> bytes:
    return encode_spans(spans).SerializeToString()


def json_body(spans, *, proto_names: bool = False) -> bytes:
    """OTLP-JSON as the spec writes it: protobuf JSON mapping, ids in hex."""
    doc = json_format.MessageToDict(encode_spans(spans), preserving_proto_field_name=proto_names)
    rs_key, ss_key = ("resource_spans", "scope_spans") if proto_names else ("resourceSpans", "scopeSpans")
    id_keys = ("trace_id", "span_id", "parent_span_id") if proto_names else ("traceId", "spanId", "parentSpanId")
    for rs in doc[rs_key]:
        for ss in rs[ss_key]:
            for span in ss["spans"]:
                for k in id_keys:
                    if k in span:
                        span[k] = base64.b64decode(span[k]).hex()
    doc["someFutureField"] = {"x": 1}  # receivers ignore unknown fields
    return json.dumps(doc).encode()


def trace_ids(spans) -> list[str]:
    return sorted({format(s.context.trace_id, "032x") for s in spans})


def stored(path, tids) -> dict:
    with store.reading(path) as c:
        return store.spans_for(c, tids)


# ------------------------------------------------------------------ decode
def test_protobuf_from_the_sdk_decodes_to_readable_spans(sdk_spans):
    received = otlp.decode(pb_body(sdk_spans), "application/x-protobuf")
    assert len(received) == len(sdk_spans) > 20
    assert all(type(w) is ReadableSpan for w in received)
    by_id = {w.context.span_id: w for w in received}
    for s in sdk_spans:
        w = by_id[s.context.span_id]
        assert (w.name, w.start_time, w.end_time) == (s.name, s.start_time, s.end_time)
        assert w.context.trace_id == s.context.trace_id and w.context.is_valid
        assert w.context.trace_flags.sampled and w.context.is_remote is False
        assert (w.parent.span_id if w.parent else None) == (s.parent.span_id if s.parent else None)
        assert (w.parent.is_remote if w.parent else None) == (s.parent.is_remote if s.parent else None)
        assert isinstance(w.resource, Resource) and w.resource.attributes == s.resource.attributes
        assert w.instrumentation_scope == s.instrumentation_scope
        assert (w.kind, w.status.status_code) == (s.kind, s.status.status_code)
        expected = dict(s.attributes)
        expected["service.name"] = s.resource.attributes["service.name"]  # the span keeps its origin
        assert w.attributes == expected
    assert any(isinstance(w.attributes.get(sc.ATTR_DEFERRED), bool) for w in received)
    assert any(isinstance(w.attributes.get(sc.ATTR_NIXL_XFER_S), float) for w in received)


@pytest.mark.parametrize("proto_names", [False, True], ids=["lowerCamel", "proto_names"])
def test_otlp_json_decodes_like_protobuf(sdk_spans, proto_names):
    from_pb = otlp.decode(pb_body(sdk_spans), "application/x-protobuf")
    from_js = otlp.decode(json_body(sdk_spans, proto_names=proto_names), "application/json; charset=utf-8")

    def shape(w):
        return (
            w.name,
            w.start_time,
            w.end_time,
            w.context.trace_id,
            w.context.span_id,
            w.parent.span_id if w.parent else None,
            dict(w.attributes),
            dict(w.resource.attributes),
            w.status.status_code,
        )

    assert [shape(w) for w in from_js] == [shape(w) for w in from_pb]


def _kv(key, **value):
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(**value))


@pytest.mark.parametrize("decode", [otlp.decode, wire.decode], ids=["sdk", "wire"])
def test_anyvalue_types_and_span_ids_are_checked(decode):
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(_kv("service.name", string_value="vllm-decode"))
    sp = rs.scope_spans.add().spans.add(
        name="llm_request",
        trace_id=b"\x01" * 16,
        span_id=b"\x02" * 8,
        parent_span_id=b"\x00" * 8,
        start_time_unix_nano=5,
        end_time_unix_nano=9,
    )
    arr = common_pb2.ArrayValue(values=[common_pb2.AnyValue(int_value=1), common_pb2.AnyValue(string_value="b")])
    kvl = common_pb2.KeyValueList(
        values=[
            _kv("n", double_value=1.5),
            _kv("xs", array_value=common_pb2.ArrayValue(values=[common_pb2.AnyValue(bool_value=True)])),
        ]
    )
    sp.attributes.extend(
        [
            _kv("s", string_value="x"),
            _kv("i", int_value=-7),
            _kv("d", double_value=0.25),
            _kv("b", bool_value=False),
            _kv("a", array_value=arr),
            _kv("k", kvlist_value=kvl),
            _kv("raw", bytes_value=b"\xca\xfe"),
            common_pb2.KeyValue(key="empty"),
        ]
    )
    (w,) = decode(req.SerializeToString(), "application/x-protobuf")
    assert w.attributes == {
        "s": "x",
        "i": -7,
        "d": 0.25,
        "b": False,
        "a": (1, "b"),
        "k": {"n": 1.5, "xs": [True]},
        "raw": "cafe",
        "service.name": "vllm-decode",
    }
    assert w.parent is None  # an all-zero parent id is "no parent"
    json.dumps(dict(w.attributes))  # what the store does with them

    for field, value, words in [
        ("trace_id", b"", "missing trace id"),
        ("span_id", b"\x00" * 8, "all zeros"),
        ("span_id", b"\x01" * 4, "span id has 4 bytes"),
        ("parent_span_id", b"\x01" * 3, "parent span id has 3 bytes"),
    ]:
        bad = ExportTraceServiceRequest()
        bad.CopyFrom(req)
        setattr(bad.resource_spans[0].scope_spans[0].spans[0], field, value)
        with pytest.raises(otlp.OTLPError) as e:
            decode(bad.SerializeToString(), "application/x-protobuf")
        assert e.value.status == 400 and e.value.reason == "invalid_span"
        assert words in e.value.message and "span #0 'llm_request'" in e.value.message


def test_status_kind_flags_and_trace_state_are_decoded():
    from opentelemetry.proto.trace.v1 import trace_pb2
    from opentelemetry.trace import SpanKind, StatusCode

    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add(schema_url="https://example.org/r")
    ss = rs.scope_spans.add()
    ss.scope.name, ss.scope.version = "vllm", "0.9"
    common = dict(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, start_time_unix_nano=5, end_time_unix_nano=9)
    ss.spans.add(
        name="err",
        kind=trace_pb2.Span.SPAN_KIND_SERVER,
        status=trace_pb2.Status(code=trace_pb2.Status.STATUS_CODE_ERROR, message="boom"),
        trace_state="k=v",
        parent_span_id=b"\x03" * 8,
        flags=0x301,  # has is_remote, parent is remote, sampled
        **common,
    )
    ss.spans.add(name="ok", status=trace_pb2.Status(code=trace_pb2.Status.STATUS_CODE_OK), **common)
    err, ok = otlp.decode(req.SerializeToString(), "application/x-protobuf")
    assert (err.kind, err.status.status_code, err.status.description) == (SpanKind.SERVER, StatusCode.ERROR, "boom")
    assert err.context.trace_state.get("k") == "v"
    assert err.parent.span_id == 0x0303030303030303 and err.parent.is_remote
    assert err.instrumentation_scope.name == "vllm" and err.instrumentation_scope.version == "0.9"
    assert err.resource.schema_url == "https://example.org/r" and dict(err.resource.attributes) == {}
    assert (ok.kind, ok.status.status_code, ok.parent) == (SpanKind.INTERNAL, StatusCode.OK, None)
    assert ok.context.trace_flags.sampled  # exported means sampled, whatever the flags say


# ------------------------------------------------- store and metrics parity
@pytest.mark.parametrize("decode", [otlp.decode, wire.decode], ids=["sdk", "wire"])
def test_store_content_equals_what_the_sdk_exporter_writes(sdk_spans, tmp_path, decode):
    sdk_db, wire_db = tmp_path / "sdk.db", tmp_path / "wire.db"
    exp = store.StoreSpanExporter(sdk_db)
    exp.export(sdk_spans)
    exp.shutdown()
    conn = store.connect(wire_db)
    store.write_spans(conn, decode(pb_body(sdk_spans), "application/x-protobuf"))
    conn.close()
    tids = trace_ids(sdk_spans)
    a, b = stored(sdk_db, tids), stored(wire_db, tids)
    assert sum(map(len, a.values())) == len(sdk_spans)
    for tid in tids:
        assert len(a[tid]) == len(b[tid])
        for x, y in zip(a[tid], b[tid]):
            svc = y["attributes"].pop("service.name")
            assert svc.startswith("kvlens-") and x == y
    with store.reading(sdk_db) as c1, store.reading(wire_db) as c2:
        assert store.slowest(c1, 50, order="start") == store.slowest(c2, 50, order="start")


def test_derived_phases_read_lean_equal_the_whole_trace_model(sdk_spans, tmp_path):
    """The resolver's read of a trace's derived phases (only the spans they
    need) gives what the whole trace model (``tracemodel.find``) derives."""
    from kvtrace import tracemodel

    conn = store.connect(tmp_path / "s.db")
    store.write_spans(conn, wire.decode(pb_body(sdk_spans), "application/x-protobuf"))
    rows = store.handoffs(conn, trace_ids(sdk_spans))
    whole = {
        tid: sorted(
            (d.name, d.role, d.start_ns, d.end_ns, d.outcome) for d in tr.spans if d.attributes.get(sc.ATTR_DERIVED)
        )
        for tid, tr in tracemodel.find(conn, list(rows)).items()
    }
    lean = tracemodel.derived_of(conn, {t: r["clock_offset_s"] for t, r in rows.items()})
    conn.close()
    assert len(rows) == 4 and all(whole.values())
    assert {t: sorted(tuple(d[:4]) + (d.outcome,) for d in ds) for t, ds in lean.items()} == whole


@pytest.mark.parametrize("decode", [otlp.decode, wire.decode], ids=["sdk", "wire"])
def test_metrics_processor_reads_wire_spans_like_sdk_spans(sdk_spans, tmp_path, decode):
    def samples(spans):
        reg = CollectorRegistry()
        proc = PhaseMetricsProcessor(reg, store_path=tmp_path / "none.db", handoff_from="off", exemplars=True)
        for s in spans:
            proc.on_end(s)
        proc.shutdown()
        return sorted(
            (s.name, tuple(sorted(s.labels.items())), s.value)
            for mf in reg.collect()
            for s in mf.samples
            if not s.name.endswith("_created")
        )

    got = samples(decode(pb_body(sdk_spans), "application/x-protobuf"))
    assert got == samples(sdk_spans)
    assert any(n == "kvlens_phase_duration_seconds_count" and ("phase", "write.complete") in lab for n, lab, _ in got)


# ------------------------------------------------------------------ HTTP
@pytest.fixture
def collector(tmp_path):
    """(client, ingest, registry, store path) of a live collector app."""
    reg = CollectorRegistry()
    db = tmp_path / "traces.db"
    ing = collector_ingest(db, reg, handoff_deadline_s=1.0)
    with TestClient(create_app(ing, reg, max_body_bytes=256 * 1024)) as client:
        yield client, ing, reg, db


def drained(ing: Ingest) -> bool:
    return wait_for(lambda: ing.queued_spans == 0)


def test_bad_requests_are_refused_and_the_collector_keeps_serving(collector):
    client, ing, reg, db = collector
    accepted = []

    def good(kind="pb"):
        spans = record_spans(1)
        body, hdr = (pb_body(spans), PB) if kind == "pb" else (json_body(spans), JS)
        r = client.post("/v1/traces", content=body, headers=hdr)
        assert r.status_code == 200 and r.content == (b"" if kind == "pb" else b"{}")
        accepted.extend(spans)

    good()
    body = pb_body(record_spans(1))
    r = client.post("/v1/traces", content=body[: len(body) // 2 + 3], headers=PB)
    assert r.status_code == 400 and b"invalid OTLP protobuf" in r.content
    good("json")
    r = client.post("/v1/traces", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "text/plain" in r.json()["message"]
    r = client.post("/v1/traces", content=b"\0" * (256 * 1024 + 1), headers=PB)
    assert r.status_code == 413
    r = client.post(
        "/v1/traces", content=gzip.compress(b"\0" * (2 * 1024 * 1024)), headers={**PB, "content-encoding": "gzip"}
    )  # small on the wire, large inside
    assert r.status_code == 413
    r = client.post("/v1/traces", content=iter([b"\0" * 100_000] * 3), headers=PB)  # chunked: no Content-Length
    assert r.status_code == 413
    good()
    bad = ExportTraceServiceRequest.FromString(body)
    bad.resource_spans[0].scope_spans[0].spans[1].ClearField("span_id")
    r = client.post("/v1/traces", content=bad.SerializeToString(), headers=PB)
    assert r.status_code == 400
    assert re.search(r"span #1 '[\w.]+'.*missing span id", r.content.decode("utf-8", "replace"))
    doc = json.loads(json_body(record_spans(1)))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = "not-hex"
    r = client.post("/v1/traces", content=json.dumps(doc), headers=JS)
    assert r.status_code == 400 and "not hex" in r.json()["message"]
    r = client.post("/v1/traces", content=b"[1, 2", headers=JS)
    assert r.status_code == 400 and "invalid OTLP JSON" in r.json()["message"]
    good()
    r = client.post(
        "/v1/traces", content=gzip.compress(pb_body(accepted[:5])), headers={**PB, "content-encoding": "gzip"}
    )
    assert r.status_code == 200
    assert drained(ing)
    got = stored(db, trace_ids(accepted))
    assert sum(map(len, got.values())) == len(accepted)
    val = reg.get_sample_value
    for reason, n in [("decode", 2), ("content_type", 1), ("too_large", 3), ("invalid_span", 2)]:
        assert val("kvlens_collector_requests_rejected_total", {"reason": reason}) == n, reason
    assert val("kvlens_collector_spans_written_total") == len(accepted) + 5
    assert client.get("/healthz").json()["status"] == "ok"


@pytest.mark.parametrize("inline", [0, 16 * 1024 * 1024])
def test_bodies_decoded_on_the_loop_or_in_a_thread_land_alike(tmp_path, inline):
    """The receiver decodes a body on the event loop or in a worker thread
    (``inline_decode_bytes``: the collector's app all on the loop, the
    router's small ones): either way every span lands and errors are the same."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    from collector.app import receiver

    reg, db = CollectorRegistry(), tmp_path / "traces.db"
    ing = collector_ingest(db, reg, handoff_deadline_s=1.0)
    app = Starlette(routes=[Route("/v1/traces", receiver(ing, inline_decode_bytes=inline), methods=["POST"])])
    small, large = record_spans(1), record_spans(40)
    bodies = [pb_body(small), pb_body(large)]
    assert len(bodies[0]) <= INLINE_DECODE_BYTES < len(bodies[1])
    try:
        with TestClient(app) as client:
            for b in bodies:
                assert client.post("/v1/traces", content=b, headers=PB).status_code == 200
            bad = ExportTraceServiceRequest.FromString(bodies[1])
            bad.resource_spans[0].scope_spans[0].spans[3].ClearField("trace_id")
            r = client.post("/v1/traces", content=bad.SerializeToString(), headers=PB)
            assert r.status_code == 400 and "span #3" in r.content.decode("utf-8", "replace")
            assert drained(ing)
    finally:
        ing.close(10)
    got = stored(db, trace_ids(small + large))
    assert sum(map(len, got.values())) == len(small) + len(large)
    assert reg.get_sample_value("kvlens_collector_requests_rejected_total", {"reason": "invalid_span"}) == 1


def test_collector_metrics_carry_phases_handoff_and_exemplars(collector):
    client, ing, reg, _ = collector
    spans = record_spans(2)
    assert client.post("/v1/traces", content=pb_body(spans), headers=PB).status_code == 200
    val = reg.get_sample_value

    def settled(mode):
        requests = val("kvlens_requests_total", {"mode": mode, "outcome": "ok"}) or 0
        handoffs = val("kvlens_handoff_seconds_count", {"mode": mode}) or 0
        unresolved = sum(
            s.value
            for mf in reg.collect()
            if mf.name == "kvlens_handoff_unresolved"
            for s in mf.samples
            if s.name.endswith("_total") and s.labels["mode"] == mode
        )
        return requests == 2 and handoffs + unresolved == requests

    assert wait_for(lambda: settled("push") and settled("pull"))
    text = client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}).text
    assert re.search(
        r'kvlens_phase_duration_seconds_bucket\{.*phase="write.complete".*\} \d+(\.0)? # '
        r'\{trace_id="[0-9a-f]{32}"\}',
        text,
    )
    assert "kvlens_collector_spans_written_total" in text


@pytest.mark.parametrize("busy", [429, 503])
def test_queue_full_answers_busy_with_retry_after_and_counts_it(tmp_path, busy):
    db = tmp_path / "traces.db"
    store.connect(db).close()
    spans = record_spans(1)
    reg = CollectorRegistry()
    ing = Ingest(db, max_queue_spans=len(spans) + 1, registry=reg, busy_retry_s=30.0)
    holder = store.connect(db)
    with TestClient(create_app(ing, reg, busy_status=busy)) as client:
        with write_tx(holder):  # another writer holds the store: the batch waits, the queue stays full
            assert client.post("/v1/traces", content=pb_body(spans), headers=PB).status_code == 200
            r = client.post("/v1/traces", content=json_body(spans), headers=JS)
            assert r.status_code == busy and r.headers["retry-after"] == "1"
            assert "queue is full" in r.json()["message"]
            assert reg.get_sample_value("kvlens_collector_requests_rejected_total", {"reason": "queue_full"}) == 1
            assert reg.get_sample_value("kvlens_collector_queue_spans") == len(spans)
        assert drained(ing)  # lock released: the waiting batch goes in, the client's retry is taken
        assert client.post("/v1/traces", content=json_body(spans), headers=JS).status_code == 200
        assert drained(ing)
    holder.close()
    assert sum(map(len, stored(db, trace_ids(spans)).values())) == len(spans)
    assert ing.counts() == {"received": 2 * len(spans), "written": 2 * len(spans), "dropped": 0, "queued": 0}


def test_a_store_locked_too_long_drops_and_counts_then_recovers(tmp_path):
    db = tmp_path / "traces.db"
    store.connect(db).close()
    spans = record_spans(1)
    received = otlp.decode(pb_body(spans), "application/x-protobuf")
    seen = []
    ing = Ingest(db, busy_retry_s=0.3, on_written=lambda batch: (seen.append(len(batch)), 1 / 0))
    holder = store.connect(db)
    with write_tx(holder):
        assert ing.offer(received)
        assert wait_for(lambda: ing.counts()["dropped"] == len(received))
    holder.close()
    assert ing.offer(received) and ing.offer(received[:3])
    assert wait_for(lambda: ing.counts()["written"] == len(received) + 3)  # a raising on_written stops nothing
    ing.close(5)
    assert ing.registry.get_sample_value("kvlens_collector_spans_dropped_total", {"reason": "store_error"}) == len(
        received
    )
    assert sum(seen) == len(received) + 3
    assert not ing.offer(received)  # closed
    c = ing.counts()
    assert c["received"] == c["written"] + c["dropped"] + c["queued"]


def test_close_flushes_what_it_can_and_counts_the_rest(tmp_path):
    db = tmp_path / "traces.db"
    store.connect(db).close()
    wire = otlp.decode(pb_body(record_spans(1)), "application/x-protobuf")
    ing = Ingest(db, batch_spans=5, busy_retry_s=30.0)
    holder = store.connect(db)
    with write_tx(holder):
        assert ing.offer(wire[:10]) and ing.offer(wire[10:])
        ing.close(0.3)  # the store stays locked past the timeout
    holder.close()
    c = ing.counts()
    assert c["written"] == 0 and c["dropped"] == len(wire) == c["received"]
    assert ing.registry.get_sample_value("kvlens_collector_spans_dropped_total", {"reason": "shutdown"}) == len(wire)

    ok = Ingest(db)
    assert ok.offer(wire)
    ok.close(10)
    assert ok.counts()["written"] == len(wire)


def test_mount_receiver_on_a_fastapi_app(tmp_path):
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def catch_all(path: str):
        return {"catch_all": path}

    served = CollectorRegistry()  # what the host app already serves on /metrics
    ing = Ingest(tmp_path / "traces.db")
    mount_receiver(app, ing, served, max_body_bytes=1024 * 1024)
    spans = record_spans(1)
    with TestClient(app) as client:
        assert client.post("/v1/traces", content=pb_body(spans), headers=PB).status_code == 200
        assert client.post("/v1/traces", content=b"x", headers={"content-type": "text/csv"}).status_code == 415
        assert client.get("/other").json() == {"catch_all": "other"}
    ing.close(10)
    assert served.get_sample_value("kvlens_collector_spans_written_total") == len(spans)
    assert served.get_sample_value("kvlens_collector_requests_rejected_total", {"reason": "content_type"}) == 1


# --------------------------------------------------------------------- CLI
def test_cli_refuses_a_bad_store_and_a_busy_port(tmp_path, capsys):
    from kvlens.cli import main

    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    assert main(["collect", "--store", str(junk), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(junk) in err[0] and err[0].startswith("kvlens collect:")
    assert main(["collect", "--store", str(tmp_path), "--port", "0"]) == 2
    assert "is a directory" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["collect", "--store", str(tmp_path / "ok.db"), "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_kvlens_collect_receives_the_sdk_exporter_and_flushes_on_sigterm(tmp_path, backend):
    """The real command, on a file and on a PostgreSQL database (``backend``)."""
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    db = backend.store if backend.is_pg else tmp_path / "collected.db"
    env = {**os.environ, "KVLENS_HOME": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlens.cli", "collect", "--port", "0", "--no-grpc", "--store", str(db)]
        + ["--retention", "30d"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        m = re.search(r"receiving OTLP/HTTP on (http://127\.0\.0\.1:\d+/v1/traces), writing (.+)$", line.strip())
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        assert m.group(2) == str(db)
        spans = record_spans(3)
        for compression in (Compression.NoCompression, Compression.Gzip):
            exporter = OTLPSpanExporter(endpoint=m.group(1), timeout=10, compression=compression)
            half = len(spans) // 2
            part = spans[:half] if compression == Compression.NoCompression else spans[half:]
            assert exporter.export(part).name == "SUCCESS"
            exporter.shutdown()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert f"{len(spans)} spans written, 0 dropped" in out
    got = stored(db, trace_ids(spans))
    assert sum(map(len, got.values())) == len(spans)


# ------------------------------------------------------------ in the router
def test_the_router_hosts_the_receiver_with_collect(tmp_path, sdk_spans):
    """``kvlens proxy --collect``: P's and D's spans posted to the router land
    in the router's store (where its handoff resolver reads), the router's
    own routes still answer, and the ingest is flushed at shutdown."""
    from proxy.app import create_app as router_app
    from proxy.config import ProxyConfig

    cfg = ProxyConfig(
        prefill_url="http://127.0.0.1:9",
        decode_url="http://127.0.0.1:9",
        mode="pull",
        kvlens_home=str(tmp_path),
        collect=True,
        telemetry=False,
        retention="7d",
    )
    with TestClient(router_app(cfg), base_url="http://127.0.0.1") as c:  # the router checks Host
        r = c.post("/v1/traces", content=pb_body(sdk_spans), headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 200, r.text
        bad = c.post("/v1/traces", content=b"\x0a\xff", headers={"Content-Type": "application/x-protobuf"})
        assert bad.status_code == 400 and "protobuf" in bad.text
        assert "kvlens_collector_spans_received_total" in c.get("/metrics").text
    got = stored(tmp_path / "traces.db", trace_ids(sdk_spans))
    assert sum(len(v) for v in got.values()) == len(sdk_spans)


def test_the_router_receiver_writes_a_postgresql_store(tmp_path, sdk_spans, pg_url):
    """``kvlens proxy --collect --store URL``: the receiver's queue writes the
    database (the app around it is the one tested above)."""
    from proxy.app import _receiver_ingest
    from proxy.config import ProxyConfig

    cfg = ProxyConfig(
        prefill_url="http://127.0.0.1:9",
        decode_url="http://127.0.0.1:9",
        mode="pull",
        kvlens_home=str(tmp_path),
        collect=True,
        telemetry=False,
        store=pg_url,
        retention="7d",
    )
    ing = _receiver_ingest(cfg)
    assert ing.location.url == pg_url and ing.retention.keep_s == 7 * 86400
    assert ing.offer(sdk_spans)
    ing.close(10.0)
    assert ing.counts()["written"] == len(sdk_spans)
    got = stored(pg_url, trace_ids(sdk_spans))
    assert sum(len(v) for v in got.values()) == len(sdk_spans)


def test_router_store_option_takes_only_a_postgresql_url(tmp_path):
    from proxy.config import ProxyConfig

    kw = dict(prefill_url="http://127.0.0.1:9", decode_url="http://127.0.0.1:9", mode="pull", telemetry=False)
    with pytest.raises(ValueError, match="store must be a postgresql://"):
        ProxyConfig(**kw, store=str(tmp_path / "x.db"))
    with pytest.raises(ValueError, match="invalid duration"):
        ProxyConfig(**kw, retention="a week")
    cfg = ProxyConfig(**kw, kvlens_home=str(tmp_path), store="postgresql://u@h/db", retention="7d")
    assert cfg.pipeline_config() == {
        "kvlens_home": str(tmp_path),
        "kvlens_store": "postgresql://u@h/db",
        "kvlens_retention": "7d",
    }
