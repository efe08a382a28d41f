"""``kvlens collect``'s OTLP/gRPC front door (issue 42, item 2), against the
real command and real grpcio: the token is checked when a call's headers
arrive, before its message is read (calls whose message never comes are
refused at once, and an exporter with the token is served meanwhile);
nothing of a refused call is stored; a compressed bomb is refused without
its inflated size being allocated (the collector's peak RSS, read from
``/proc``); gzip and deflate from a real client still land. The latency an
exporter sees while such uploads are open is a benchmark figure
(``benchmarks/bench_grpc_front.py``), not asserted here."""

from __future__ import annotations

import secrets
import threading
import zlib

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

from collect_proc import Collect
from collector.grpc_receiver import EXPORT_PATH, WORKERS, message_encoding
from kvrecord.config import TOKEN_ENV
from test_collector import pb_body, record_spans, stored, trace_ids

TOKEN = "kvlens-grpc-" + secrets.token_hex(12)
REJECTED = "kvlens_collector_requests_rejected_total"
AUTH = {"headers": {"Authorization": f"Bearer {TOKEN}"}}  # /metrics wants the token too
RECEIVED = "kvlens_collector_spans_received_total"


def _n_stored(db, spans) -> int:
    return sum(map(len, stored(db, trace_ids(spans)).values()))


class _Upload:
    """A request stream whose message has not come yet: it yields ``body``
    only once ``release`` is set (an upload still on its way)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.release = threading.Event()
        self.yielded = 0

    def __iter__(self):
        self.release.wait(60)
        self.yielded += 1
        yield self.body


def _peak_rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_no_token_is_refused_before_the_message_is_read_and_others_are_served(tmp_path):
    refused, good = record_spans(1), record_spans(1)
    n = 2 * WORKERS  # more than the workers: before issue 42 these stalled every exporter
    c = Collect(tmp_path, env={TOKEN_ENV: TOKEN})
    uploads = [_Upload(pb_body(refused)) for _ in range(n)]
    channel = grpc.insecure_channel(c.grpc)
    try:
        calls = []
        for i, up in enumerate(uploads):
            md = (("authorization", "Bearer wrong-token-0123456789"),) if i % 2 else None
            # a client-streaming call sends the headers now and the message when the iterator yields
            calls.append(channel.stream_unary(EXPORT_PATH).future(iter(up), timeout=60, metadata=md))
        codes = [call.exception().code() if call.exception() else None for call in calls]
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * n
        assert [up.yielded for up in uploads] == [0] * n  # answered while no message had been sent
        assert "missing bearer token" in calls[0].exception().details()
        assert "wrong bearer token" in calls[1].exception().details()
        # uploads without a token whose message is on its way: an exporter with the token is served
        pending = [_Upload(pb_body(refused)) for _ in range(n)]
        for up in pending:
            channel.stream_unary(EXPORT_PATH).future(iter(up), timeout=60)
        exporter = GrpcExporter(
            endpoint=f"http://{c.grpc}", insecure=True, timeout=30, headers={"authorization": f"Bearer {TOKEN}"}
        )
        assert exporter.export(good).name == "SUCCESS"
        exporter.shutdown()
        for up in pending:
            up.release.set()
        assert c.metric(REJECTED, {"reason": "unauthenticated"}, **AUTH) == 2 * n
        assert c.metric(RECEIVED, **AUTH) == len(good)
    finally:
        for up in uploads:
            up.release.set()
        channel.close()
        rc, out, err = c.stop()
    assert rc == 0, err
    assert _n_stored(c.store, refused) == 0 and _n_stored(c.store, good) == len(good)


def _gzip_of_zeros(n_mib: int) -> bytes:
    """gzip of ``n_mib`` MiB of zeros, made a MiB at a time (never holding the inflated bytes)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    return b"".join([*(z.compress(block) for _ in range(n_mib)), z.flush()])


def test_a_compressed_bomb_is_refused_without_inflating_it(tmp_path):
    spans = record_spans(1)
    bomb = _gzip_of_zeros(1024)  # 1 GiB inflated, ~1 MiB on the wire
    assert len(bomb) < 2 << 20 and message_encoding(bomb) == "gzip"
    c = Collect(tmp_path, "--max-body-mb", "4", env={TOKEN_ENV: TOKEN})
    md = (("authorization", f"Bearer {TOKEN}"),)
    try:
        with grpc.insecure_channel(c.grpc, options=[("grpc.max_send_message_length", -1)]) as ch:
            export = ch.unary_unary(EXPORT_PATH)
            assert export(pb_body(spans), timeout=30, metadata=md) == b""  # warm: the first call's own cost
            before = _peak_rss_kib(c.proc.pid)
            # the bomb as gzip bytes in a plain message (what gRPC hands over with its decompression off) ...
            with pytest.raises(grpc.RpcError) as e:
                export(bomb, timeout=60, metadata=md)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "once decompressed" in e.value.details()
            # ... and 256 MiB compressed by gRPC itself (grpc-encoding: gzip)
            with pytest.raises(grpc.RpcError) as e:
                export(bytes(256 << 20), timeout=60, metadata=md, compression=grpc.Compression.Gzip)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "once decompressed" in e.value.details()
            grown_mib = (_peak_rss_kib(c.proc.pid) - before) / 1024
        # the inflated sizes were 1024 and 256 MiB; what was allocated is the compressed message and
        # at most the 4 MiB cap of inflated bytes, far under either
        assert grown_mib < 64, f"the collector's peak RSS grew {grown_mib:.0f} MiB"
        assert c.metric(REJECTED, {"reason": "too_large"}, **AUTH) == 2
    finally:
        rc, out, err = c.stop()
    assert rc == 0, err


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
def test_compressed_exports_within_the_cap_land(tmp_path, compression):
    spans = record_spans(2)
    c = Collect(tmp_path, env={TOKEN_ENV: TOKEN})
    try:
        exporter = GrpcExporter(
            endpoint=f"http://{c.grpc}",
            insecure=True,
            timeout=30,
            compression=compression,
            headers={"authorization": f"Bearer {TOKEN}"},
        )
        assert exporter.export(spans).name == "SUCCESS"
        exporter.shutdown()
    finally:
        rc, out, err = c.stop()
    assert rc == 0, err
    assert _n_stored(c.store, spans) == len(spans)


def test_message_encoding_reads_the_first_bytes():
    body = pb_body(record_spans(1))
    assert body[:1] == b"\x0a" and message_encoding(body) is None
    assert message_encoding(zlib.compress(body)) == "deflate"
    assert message_encoding(zlib.compress(body, wbits=31)) == "gzip"
    assert message_encoding(b"") is None and message_encoding(b"\x1f") is None
