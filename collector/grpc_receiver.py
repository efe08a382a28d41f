"""The collector's gRPC side: OTLP/gRPC ``TraceService/Export``
(``opentelemetry.proto.collector.trace.v1``), the protocol the OpenTelemetry
Collector's ``loadbalancing`` exporter and most SDKs speak on port 4317.

The same road as ``POST /v1/traces`` (:mod:`collector.app`): a
generic handler with no request deserializer hands over the request's raw
protobuf bytes, which :func:`collector.wire.decode` checks and
decodes exactly as an HTTP body, onto the same
:class:`~collector.ingest.Ingest` queue, with the same counters.

**The token before the message** (issue 42). grpcio reads a unary call's
whole message on a worker thread before its handler runs, so a handler that
checked the token itself let a client without one hold a worker while its
upload trickled in (:data:`WORKERS` such uploads stalled every exporter).
The check is a server interceptor (:class:`TokenFirst`): it runs when the
call's headers arrive, on grpcio's own polling thread, and answers a call
without the right ``authorization`` metadata with a handler that reads
nothing and aborts ``UNAUTHENTICATED`` at once; the message is never read,
inflated or decoded.

**Inflation is ours, and bounded.** gRPC's own decompression is turned off
(``grpc.per_message_decompression``: grpcio releases differ in whether they
bound it): a compressed message reaches :func:`export_handler` as sent,
at most ``max_body_bytes`` on the wire (``grpc.max_receive_message_length``,
the same cap), and is inflated by :func:`collector.otlp.decompress`,
which never produces more than ``max_body_bytes`` + 1 bytes whatever the
ratio (a gzip bomb costs its compressed size, not its inflated one). gRPC
passes no ``grpc-encoding`` to the handler, so the encoding is read from the
message itself (:func:`message_encoding`): a protobuf
``ExportTraceServiceRequest`` never starts with gzip's ``1f 8b`` (wire type
7 does not exist) nor with a zlib header.

Answers:

* a token set and the ``authorization`` metadata missing or wrong:
  ``UNAUTHENTICATED`` before the message is read, counted ``unauthenticated``;
* a message over ``max_body_bytes`` on the wire: refused by gRPC itself
  (``RESOURCE_EXHAUSTED``) before kvlens sees it, not counted; over it once
  inflated: ``INVALID_ARGUMENT`` (sending it again cannot help), counted
  ``too_large``;
* a malformed message or a span without valid ids: ``INVALID_ARGUMENT``
  naming it, counted as over HTTP (``decode``, ``invalid_span``);
* the write queue full: ``RESOURCE_EXHAUSTED`` with a ``RetryInfo`` of
  :data:`~collector.app.RETRY_AFTER_S` (what OTLP exporters
  retry), or ``UNAVAILABLE`` with ``busy_status=503``; shutting down:
  ``UNAVAILABLE``;
* success: an empty ``ExportTraceServiceResponse``.

The server runs on its own bounded thread pool (:data:`WORKERS` threads,
at most :data:`MAX_CONCURRENT_RPCS` calls in flight, gRPC answers
``RESOURCE_EXHAUSTED`` beyond that; at most :data:`MAX_STREAMS_PER_CONNECTION`
calls at once on one connection), in the collector's process; a connection
with no call for :data:`MAX_IDLE_MS` is closed (exporters reconnect by
themselves). An *authenticated* client that uploads slowly still holds a
worker while its message arrives: the token is what keeps strangers out.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from collector import otlp, wire
from collector.app import DEFAULT_MAX_BODY_BYTES, RETRY_AFTER_S
from collector.ingest import Ingest
from frontdoor.credentials import Security

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METHOD = "Export"
EXPORT_PATH = f"/{SERVICE}/{METHOD}"
#: Worker threads: decoding holds the GIL, so more would not decode faster;
#: a few let a slow client's call wait without stalling the others.
WORKERS = 4
MAX_CONCURRENT_RPCS = 256
#: Calls at once on one HTTP/2 connection (gRPC's default has no limit);
#: an exporter sends one or a few at a time.
MAX_STREAMS_PER_CONNECTION = 32
#: A connection with no call for this long is closed (gRPC's default: never).
MAX_IDLE_MS = 5 * 60 * 1000
#: How often gRPC pings a connection with calls in flight, and how long it waits for the answer,
#: so a peer that vanished mid-upload frees its call (gRPC's default: every 2 hours).
KEEPALIVE_MS = 60 * 1000
KEEPALIVE_TIMEOUT_MS = 20 * 1000
_OK = ExportTraceServiceResponse().SerializeToString()
_RETRY_INFO = RetryInfo(retry_delay=Duration(seconds=RETRY_AFTER_S)).SerializeToString()


def message_encoding(message: bytes) -> str | None:
    """How a message gRPC did not inflate was compressed: ``"gzip"``
    (RFC 1952: ``1f 8b``), ``"deflate"`` (gRPC's deflate is RFC 1950 zlib:
    method 8 and a header checksum divisible by 31), or None (plain
    protobuf; an ``ExportTraceServiceRequest`` starts with ``0a``, field 1)."""
    if message[:2] == b"\x1f\x8b":
        return "gzip"
    if (
        len(message) >= 2
        and message[0] & 0x0F == 8
        and message[0] >> 4 <= 7
        and (message[0] << 8 | message[1]) % 31 == 0
    ):
        return "deflate"
    return None


def _authorization(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value
    return None


class TokenFirst(grpc.ServerInterceptor):
    """Checks the ``authorization`` metadata when a call's headers arrive,
    before its message is read (module docstring): an export needs the
    ingest role (:meth:`frontdoor.credentials.Security.allows`: the ingest
    token or the all-roles one, compared in constant time). A refused
    ``Export`` is counted ``unauthenticated`` on ``ingest``; any other method
    is refused too, uncounted."""

    def __init__(self, security: Security, ingest: Ingest) -> None:
        self.security = security
        self.ingest = ingest
        self._refuse = {why: _refusal(why) for why in ("missing", "wrong")}

    def intercept_service(self, continuation, handler_call_details):
        header = _authorization(handler_call_details.invocation_metadata)
        if self.security.allows("ingest", header):
            return continuation(handler_call_details)
        if handler_call_details.method == EXPORT_PATH:
            self.ingest.reject("unauthenticated")
        return self._refuse["missing" if header is None else "wrong"]


def _refusal(why: str) -> grpc.RpcMethodHandler:
    """A handler that takes the request as a stream it never reads (so grpcio
    does not wait for the message) and aborts ``UNAUTHENTICATED``."""
    message = f"{why} bearer token (send metadata authorization: Bearer TOKEN)"

    def refuse(request_iterator, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_unary_rpc_method_handler(refuse)


def export_handler(ingest: Ingest, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, busy_status: int = 429):
    """The ``Export`` method as a gRPC behaviour ``(request_bytes, context) ->
    response_bytes``: the message (as sent: gRPC's decompression is off),
    inflated within ``max_body_bytes``, decoded and queued. The token was
    checked before (:class:`TokenFirst`). Any gRPC worker thread."""
    cap = int(max_body_bytes)
    busy_code = grpc.StatusCode.UNAVAILABLE if busy_status == 503 else grpc.StatusCode.RESOURCE_EXHAUSTED

    def export(request: bytes, context: grpc.ServicerContext) -> bytes:
        if len(request) > cap:  # gRPC's own cap is the same: a guard, should that option ever differ
            ingest.reject("too_large")
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request of {len(request)} bytes is larger than the limit of {cap} bytes",
            )
        try:
            spans = wire.decode(request, otlp.PROTOBUF, message_encoding(request), cap)
        except otlp.OTLPError as e:
            ingest.reject(e.reason)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)
        if not ingest.offer(spans):
            if ingest.closed:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the kvlens collector is shutting down; retry later")
            context.set_trailing_metadata((("google.rpc.retryinfo-bin", _RETRY_INFO),))
            context.abort(
                busy_code,
                f"the write queue is full ({ingest.queued_spans} spans waiting for the trace store); retry later",
            )
        return _OK

    return export


def server_options(max_body_bytes: int) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments (module docstring): the receive cap,
    no decompression by gRPC, per-connection streams, idle time, keepalive."""
    return [
        ("grpc.max_receive_message_length", int(max_body_bytes)),
        ("grpc.per_message_decompression", 0),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.max_connection_idle_ms", MAX_IDLE_MS),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.so_reuseport", 0),  # a second collector on the same port is an error, not a silent share
    ]


def grpc_server(
    ingest: Ingest,
    security: Security | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    busy_status: int = 429,
) -> grpc.Server:
    """A gRPC server (not started, no port yet) serving ``TraceService/Export``
    into ``ingest``. ``security``: the credentials a call must carry (the
    ingest role), checked before the message is read (:class:`TokenFirst`);
    None, or no token in it: every call may write. Add its port with
    :func:`add_port`; ``server.stop(grace)`` before ``ingest.close``."""
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            METHOD: grpc.unary_unary_rpc_method_handler(
                export_handler(ingest, max_body_bytes=max_body_bytes, busy_status=busy_status)
            )
        },
    )
    return grpc.server(
        ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kvlens-grpc"),
        handlers=[handler],
        interceptors=[TokenFirst(security, ingest)] if security is not None and security.any_token else None,
        options=server_options(max_body_bytes),
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as gRPC writes it (an IPv6 address bracketed)."""
    h = host.strip("[]")
    return f"[{h}]:{port}" if ":" in h else f"{h}:{port}"


def add_port(server: grpc.Server, host: str, port: int, creds: grpc.ServerCredentials | None = None) -> int:
    """Listen on ``host:port`` (TLS with ``creds``: :func:`frontdoor.serving.grpc_credentials`);
    the port bound (``port`` 0: a free one). RuntimeError when it cannot be bound."""
    addr = grpc_address(host, port)
    bound = server.add_secure_port(addr, creds) if creds is not None else server.add_insecure_port(addr)
    if not bound:  # older grpcio returns 0 rather than raising
        raise RuntimeError(f"failed to bind to address {addr}")
    return bound
