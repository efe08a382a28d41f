"""The collector's gRPC side: OTLP/gRPC ``TraceService/Export``
(``opentelemetry.proto.collector.trace.v1``), the protocol the OpenTelemetry
Collector's ``loadbalancing`` exporter and most SDKs speak on port 4317.

The same road as ``POST /v1/traces`` (:mod:`exporters.collector.app`): a
generic handler with no request deserializer hands over the request's raw
protobuf bytes, which :func:`exporters.collector.wire.decode` checks and
decodes exactly as an HTTP body, onto the same
:class:`~exporters.collector.ingest.Ingest` queue, with the same counters.
gRPC decompresses a gzip request itself. Answers:

* a token set and the ``authorization`` metadata missing or wrong:
  ``UNAUTHENTICATED``, counted ``unauthenticated``; nothing is decoded;
* a message over ``max_body_bytes`` (decompressed): ``INVALID_ARGUMENT``
  (sending it again cannot help), counted ``too_large``. gRPC's own transport
  cap is set at twice that (memory stays bounded): a message beyond it is
  refused by gRPC (``RESOURCE_EXHAUSTED``) before kvlens sees it, and is not
  counted;
* a malformed message or a span without valid ids: ``INVALID_ARGUMENT``
  naming it, counted as over HTTP (``decode``, ``invalid_span``);
* the write queue full: ``RESOURCE_EXHAUSTED`` with a ``RetryInfo`` of
  :data:`~exporters.collector.app.RETRY_AFTER_S` (what OTLP exporters
  retry), or ``UNAVAILABLE`` with ``busy_status=503``; shutting down:
  ``UNAVAILABLE``;
* success: an empty ``ExportTraceServiceResponse``.

The server runs on its own bounded thread pool (:data:`WORKERS` threads,
at most :data:`MAX_CONCURRENT_RPCS` calls in flight; gRPC answers
``RESOURCE_EXHAUSTED`` beyond that), in the collector's process.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from exporters.collector import otlp, wire
from exporters.collector.app import DEFAULT_MAX_BODY_BYTES, RETRY_AFTER_S
from exporters.collector.ingest import Ingest

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METHOD = "Export"
#: Worker threads: decoding holds the GIL, so more would not decode faster;
#: a few let a slow client's call wait without stalling the others.
WORKERS = 4
MAX_CONCURRENT_RPCS = 256
_OK = ExportTraceServiceResponse().SerializeToString()
_RETRY_INFO = RetryInfo(retry_delay=Duration(seconds=RETRY_AFTER_S)).SerializeToString()


def export_handler(
    ingest: Ingest,
    authorized: Callable[[str | None], bool] | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    busy_status: int = 429,
):
    """The ``Export`` method as a gRPC behaviour ``(request_bytes, context) ->
    response_bytes``. ``authorized(authorization_metadata_or_None)``: whether
    a call may write (None: every call may; ``kvlens collect`` passes
    :func:`kvlens.auth.token_ok` bound to its token). Any gRPC worker thread."""
    cap = int(max_body_bytes)
    busy_code = grpc.StatusCode.UNAVAILABLE if busy_status == 503 else grpc.StatusCode.RESOURCE_EXHAUSTED

    def export(request: bytes, context: grpc.ServicerContext) -> bytes:
        if authorized is not None:
            header = None
            for key, value in context.invocation_metadata():
                if key == "authorization":
                    header = value
                    break
            if not authorized(header):
                ingest.reject("unauthenticated")
                why = "missing" if header is None else "wrong"
                context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, f"{why} bearer token (send metadata authorization: Bearer TOKEN)"
                )
        if len(request) > cap:
            ingest.reject("too_large")
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request of {len(request)} bytes is larger than the limit of {cap} bytes",
            )
        try:
            spans = wire.decode(request, otlp.PROTOBUF, None, cap)
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


def grpc_server(
    ingest: Ingest,
    authorized: Callable[[str | None], bool] | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    busy_status: int = 429,
) -> grpc.Server:
    """A gRPC server (not started, no port yet) serving ``TraceService/Export``
    into ``ingest``. Add its port with :func:`add_port`; ``server.stop(grace)``
    before ``ingest.close``."""
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            METHOD: grpc.unary_unary_rpc_method_handler(
                export_handler(ingest, authorized, max_body_bytes=max_body_bytes, busy_status=busy_status)
            )
        },
    )
    options = [
        ("grpc.max_receive_message_length", 2 * int(max_body_bytes)),
        ("grpc.so_reuseport", 0),  # a second collector on the same port is an error, not a silent share
    ]
    return grpc.server(
        ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kvlens-grpc"),
        handlers=[handler],
        options=options,
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as gRPC writes it (an IPv6 address bracketed)."""
    h = host.strip("[]")
    return f"[{h}]:{port}" if ":" in h else f"{h}:{port}"


def add_port(server: grpc.Server, host: str, port: int, creds: grpc.ServerCredentials | None = None) -> int:
    """Listen on ``host:port`` (TLS with ``creds``: :func:`kvlens.auth.grpc_credentials`);
    the port bound (``port`` 0: a free one). RuntimeError when it cannot be bound."""
    addr = grpc_address(host, port)
    bound = server.add_secure_port(addr, creds) if creds is not None else server.add_insecure_port(addr)
    if not bound:  # older grpcio returns 0 rather than raising
        raise RuntimeError(f"failed to bind to address {addr}")
    return bound
