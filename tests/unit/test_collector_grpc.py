"""``kvlens collect``'s OTLP/gRPC side (``TraceService/Export``): the Python
SDK's real gRPC exporter, plain and gzip, into a real store; the same
counters, limits and answers as OTLP/HTTP; a full queue answers what OTLP
exporters retry; SIGTERM stops both sides and flushes. Real components: the
command, grpcio, the SDK exporters, the store."""

from __future__ import annotations

import threading

import grpc
import httpx
import pytest
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from prometheus_client import CollectorRegistry

from collect_proc import Collect
from collector.grpc_receiver import METHOD, SERVICE, add_port, grpc_address, grpc_server
from collector.ingest import Ingest
from kvtrace import store
from kvtrace.store.schema import write_tx
from fakes import wait_for
from test_collector import drained, pb_body, record_spans, stored, trace_ids

EXPORT = f"/{SERVICE}/{METHOD}"
RECEIVED = "kvlens_collector_spans_received_total"
REJECTED = "kvlens_collector_requests_rejected_total"


def _call(target: str, body: bytes, **kw):
    """One raw ``Export`` call (bytes in, bytes out), as any OTLP client sends it."""
    with grpc.insecure_channel(target) as ch:
        return ch.unary_unary(EXPORT)(body, timeout=10, **kw)


def test_the_sdk_grpc_exporter_plain_and_gzip_lands_in_the_store(tmp_path):
    spans = record_spans(3)
    third = len(spans) // 3
    parts = spans[:third], spans[third : 2 * third], spans[2 * third :]
    c = Collect(tmp_path)
    try:
        assert c.grpc and c.grpc.startswith("127.0.0.1:")
        for part, compression in zip(parts[:2], (grpc.Compression.NoCompression, grpc.Compression.Gzip)):
            exporter = GrpcExporter(endpoint=f"http://{c.grpc}", insecure=True, timeout=10, compression=compression)
            assert exporter.export(part).name == "SUCCESS"
            exporter.shutdown()
        http = HttpExporter(endpoint=f"{c.http}/v1/traces", timeout=10)  # the same collector over HTTP
        assert http.export(parts[2]).name == "SUCCESS"
        http.shutdown()
        assert c.metric(RECEIVED) == len(spans)  # one counter for both sides
    finally:
        rc, out, err = c.stop()
    assert rc == 0, err
    assert f"{len(spans)} spans written, 0 dropped" in out
    got = stored(c.store, trace_ids(spans))
    assert sum(map(len, got.values())) == len(spans)
    assert {format(s.context.span_id, "016x") for s in spans} == {r["span_id"] for rows in got.values() for r in rows}


def test_bad_and_too_large_messages_are_refused_and_counted_like_http(tmp_path):
    spans = record_spans(1)
    body = pb_body(spans)
    c = Collect(tmp_path, "--max-body-mb", str(len(body) / 2**20 / 1.5))  # the body is 1.5x the limit
    try:
        for garbage in (b"\x0a\xff", b"\x0a\x05abc"):  # a truncated length, a truncated field
            with pytest.raises(grpc.RpcError) as e:
                _call(c.grpc, garbage)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # over the cap on the wire: gRPC's own limit is the configured one (issue 42), refused before kvlens
        with pytest.raises(grpc.RpcError) as e:
            _call(c.grpc, body)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # under it compressed, over it once inflated: kvlens' answer, counted
        with pytest.raises(grpc.RpcError) as e:
            _call(c.grpc, body, compression=grpc.Compression.Gzip)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "once decompressed" in e.value.details()
        r = httpx.post(f"{c.http}/v1/traces", content=b"\x0a\xff", headers={"content-type": "application/x-protobuf"})
        assert r.status_code == 400
        assert c.metric(REJECTED, {"reason": "decode"}) == 3
        assert c.metric(REJECTED, {"reason": "too_large"}) == 1
        assert c.metric(RECEIVED) == 0
        assert _call(c.grpc, b"") == b""  # an empty request is valid OTLP: no spans
    finally:
        rc, out, err = c.stop()
    assert rc == 0, err
    assert "0 spans written" in out
    assert sum(map(len, stored(c.store, trace_ids(spans)).values())) == 0


@pytest.mark.parametrize("busy, code", [(429, grpc.StatusCode.RESOURCE_EXHAUSTED), (503, grpc.StatusCode.UNAVAILABLE)])
def test_a_full_queue_answers_what_exporters_retry(tmp_path, busy, code):
    db = tmp_path / "traces.db"
    store.connect(db).close()
    spans = record_spans(1)
    reg = CollectorRegistry()
    ing = Ingest(db, max_queue_spans=len(spans) + 1, registry=reg, busy_retry_s=30.0)
    server = grpc_server(ing, busy_status=busy)
    target = grpc_address("127.0.0.1", add_port(server, "127.0.0.1", 0))
    server.start()
    holder = store.connect(db)
    exporter = GrpcExporter(endpoint=f"http://{target}", insecure=True, timeout=20)
    result: list = []
    try:
        with write_tx(holder):  # another writer holds the store: the batch waits, the queue stays full
            assert _call(target, pb_body(spans)) == b""
            with pytest.raises(grpc.RpcError) as e:
                _call(target, pb_body(spans))
            assert e.value.code() == code and "queue is full" in e.value.details()
            retry = RetryInfo.FromString(dict(e.value.trailing_metadata())["google.rpc.retryinfo-bin"])
            assert retry.retry_delay.seconds == 1
            assert reg.get_sample_value(REJECTED, {"reason": "queue_full"}) == 1
            # the SDK's exporter is refused too, and retries after the RetryInfo's delay ...
            t = threading.Thread(target=lambda: result.append(exporter.export(spans).name))
            t.start()
            assert wait_for(lambda: reg.get_sample_value(REJECTED, {"reason": "queue_full"}) == 2)
        t.join(30)  # ... which lands once the store is free
        assert result == ["SUCCESS"]
        assert drained(ing)
        assert reg.get_sample_value(RECEIVED) == 2 * len(spans)
        server.stop(5).wait()
        with pytest.raises(grpc.RpcError) as e:
            _call(target, pb_body(spans))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # stopped: nobody listens
    finally:
        exporter.shutdown()
        server.stop(0)
        holder.close()
        ing.close(10)
    assert sum(map(len, stored(db, trace_ids(spans)).values())) == len(spans)  # the same spans twice: stored once
    assert ing.counts()["written"] == 2 * len(spans)


def test_a_busy_grpc_port_is_one_line_and_grpc_stops_with_http(tmp_path, capsys):
    from kvlens.cli import main

    c = Collect(tmp_path)
    try:
        port = c.grpc.rsplit(":", 1)[1]
        assert main(["collect", "--port", "0", "--grpc-port", port, "--store", str(tmp_path / "x.db")]) == 1
    finally:
        rc, _, err = c.stop()
    assert rc == 0, err
    with pytest.raises(grpc.RpcError) as e:  # SIGTERM stopped the gRPC side too
        _call(c.grpc, b"")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port} (OTLP/gRPC; --grpc-port, or --no-grpc)" in err
    assert main(["collect", "--port", "4999", "--grpc-port", "4999"]) == 2
    assert "--port and --grpc-port are both 4999" in capsys.readouterr().err
