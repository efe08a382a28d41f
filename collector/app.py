"""The collector's HTTP side: OTLP/HTTP ``POST /v1/traces``, ``GET /metrics``
and ``GET /healthz`` as an ASGI app (:func:`create_app`), or the receiver
route alone added to an existing app (:func:`mount_receiver`: the kvlens
router can host the receiver next to its own routes).

``POST /v1/traces`` (OTLP/HTTP, protobuf or JSON, optionally gzip/deflate):

* a body over ``max_body_bytes`` (compressed or decompressed) is refused
  with 413: at once when ``Content-Length`` says so, else as soon as the
  streamed body passes the cap (never read whole into memory);
* unsupported ``Content-Type`` / ``Content-Encoding`` -> 415; a malformed
  body or a span without valid ids -> 400 naming it (not retried);
* the spans go onto the :class:`~collector.ingest.Ingest` queue;
  a full queue answers 429 (or ``busy_status=503``; 503 always while shutting
  down) with ``Retry-After: 1``, which OTLP exporters honour and retry;
* success is 200 with an empty ``ExportTraceServiceResponse`` in the
  request's content type (protobuf bytes, or ``{}``).

Error bodies are a ``google.rpc.Status`` in the request's content type (JSON
for an unsupported one), its ``message`` naming the problem. A large body
is decoded in a worker thread, so it does not stall the event loop of an
app that also serves other routes (a small one on the loop:
:data:`INLINE_DECODE_BYTES`).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from prometheus_client import CollectorRegistry, make_asgi_app
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from collector import otlp, wire
from collector.bodycap import read_capped
from collector.ingest import Ingest
from frontdoor.bearer import DETAILS_SCOPE_KEY

TRACES_PATH = "/v1/traces"
DEFAULT_MAX_BODY_BYTES = otlp.DEFAULT_MAX_BYTES
RETRY_AFTER_S = 1
#: Where the receiver shares its event loop with other routes (the router's
#: ``--collect``: :func:`mount_receiver`), bodies up to this size are
#: decoded on the loop, larger ones in a worker thread. A fleet's exporters
#: send many small bodies (a process's spans of ~200 ms); handing each to a
#: thread cost more CPU than decoding it (a wake-up, a future, a GIL
#: hand-over: ~0.3 ms a body). 64 KiB is ~200 spans, ~1 ms on the loop at
#: most. Compressed bodies count by their wire size (they can grow 10x:
#: still a few ms). The collector's own app (:func:`create_app`) serves
#: nothing a decode could delay but its health and metrics, so it decodes
#: every body on the loop (a thread would not decode two at once either:
#: one GIL).
INLINE_DECODE_BYTES = 64 * 1024
#: google.rpc.Code values for the Status body.
_RPC_CODE = {400: 3, 401: 16, 413: 8, 415: 3, 429: 8, 503: 14}
_OK_PROTOBUF = ExportTraceServiceResponse().SerializeToString()


def _status_body(status: int, message: str, kind: str | None) -> Response:
    code = _RPC_CODE.get(status, 2)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    if kind == otlp.PROTOBUF:
        from google.rpc import status_pb2

        body = status_pb2.Status(code=code, message=message).SerializeToString()
        return Response(body, status_code=status, media_type=otlp.PROTOBUF, headers=headers)
    return JSONResponse({"code": code, "message": message}, status_code=status, headers=headers)


async def _read_capped(request: Request, cap: int) -> bytes:
    """The request body, refusing (413) as soon as it passes ``cap`` bytes."""

    def too_large(n: int | None) -> otlp.OTLPError:
        of = "" if n is None else f" of {n} bytes"
        return otlp.OTLPError(413, f"request body{of} is larger than the limit of {cap} bytes")

    def bad_length(declared: str) -> otlp.OTLPError:
        return otlp.OTLPError(400, f"invalid Content-Length {declared[:40]!r}")

    return await read_capped(request.headers, request.stream(), cap, too_large, bad_length)


def receiver(
    ingest: Ingest,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    busy_status: int = 429,
    inline_decode_bytes: int = INLINE_DECODE_BYTES,
):
    """The ``POST /v1/traces`` endpoint (``async def (request) -> Response``).
    ``busy_status``: the answer to a request that finds the queue full, 429
    (the OTLP default) or 503 (for exporters that retry only 5xx, such as
    older opentelemetry-python OTLP/HTTP exporters). ``inline_decode_bytes``:
    bodies up to this size are decoded on the event loop, larger ones in a
    worker thread (:data:`INLINE_DECODE_BYTES`)."""
    if int(max_body_bytes) <= 0:
        raise ValueError(f"max_body_bytes must be > 0, got {max_body_bytes!r}")
    if busy_status not in (429, 503):
        raise ValueError(f"busy_status must be 429 or 503, got {busy_status!r}")
    cap = int(max_body_bytes)

    async def receive_traces(request: Request) -> Response:
        kind = None
        try:
            kind = otlp.content_kind(request.headers.get("content-type"))
            body = await _read_capped(request, cap)
            encoding = request.headers.get("content-encoding")
            if len(body) <= inline_decode_bytes:
                spans = wire.decode(body, kind, encoding, cap)
            else:
                spans = await run_in_threadpool(wire.decode, body, kind, encoding, cap)
        except otlp.OTLPError as e:
            ingest.reject(e.reason)
            return _status_body(e.status, e.message, kind)
        except ClientDisconnect:
            return Response(status_code=400)
        if not ingest.offer(spans):
            if ingest.closed:
                return _status_body(503, "the kvlens collector is shutting down; retry later", kind)
            return _status_body(
                busy_status,
                f"the write queue is full ({ingest.queued_spans} spans waiting for the trace store); retry later",
                kind,
            )
        if kind == otlp.PROTOBUF:
            return Response(_OK_PROTOBUF, media_type=otlp.PROTOBUF)
        return Response(b"{}", media_type=otlp.JSON)

    return receive_traces


def mount_receiver(
    app: Starlette,
    ingest: Ingest,
    registry: CollectorRegistry | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    busy_status: int = 429,
) -> None:
    """Add ``POST /v1/traces`` to an existing Starlette/FastAPI ``app``, ahead
    of its other routes (a catch-all route cannot shadow it).

    ``registry``: the registry ``app`` already serves on its ``/metrics``;
    when given (and not ``ingest.registry`` itself) ``ingest``'s metrics are
    forwarded into it, so they show there (a metric name both already hold
    raises ``ValueError``). The caller closes ``ingest`` on shutdown
    (``ingest.close(10)`` in its lifespan)."""
    route = Route(
        TRACES_PATH, receiver(ingest, max_body_bytes=max_body_bytes, busy_status=busy_status), methods=["POST"]
    )
    app.router.routes.insert(0, route)
    if registry is not None and registry is not ingest.registry:
        registry.register(_Forward(ingest.registry))


class _Forward:
    """A prometheus_client collector that serves another registry's metrics."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self):
        return self.source.collect()

    def describe(self):
        return list(self.source.collect())


class _ASGI:
    """Wraps a plain ASGI function so ``Route`` serves it as an app."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def create_app(
    ingest: Ingest,
    registry: CollectorRegistry,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    close_timeout_s: float = 10.0,
    busy_status: int = 429,
    before_close: Callable[[], None] | None = None,
) -> Starlette:
    """The collector app: ``POST /v1/traces``, ``GET /metrics`` (``registry``
    in the exposition the scraper asks for: OpenMetrics carries exemplars),
    ``GET /healthz`` (also ``/health``: ``{"status": ...}``, plus the queue
    and the store's name unless the scope's :data:`DETAILS_SCOPE_KEY` is
    False: without the read token). Its lifespan shutdown calls
    ``before_close`` (in a thread: the gRPC side stops taking calls), then
    flushes and closes ``ingest`` (``ingest.close(close_timeout_s)``).
    (``kvlens collect`` wraps it in :class:`frontdoor.bearer.BearerAuth`.)"""
    import contextlib

    async def healthz(request: Request) -> Response:
        ok = ingest.alive()
        doc = {"status": "ok" if ok else "unavailable"}
        if request.scope.get(DETAILS_SCOPE_KEY, True):  # the read role proved, or no token at all
            doc.update(
                queue_spans=ingest.queued_spans, max_queue_spans=ingest.max_queue_spans, store=str(ingest.location)
            )
        return Response(json.dumps(doc), status_code=200 if ok else 503, media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            try:
                if before_close is not None:
                    await run_in_threadpool(before_close)
            finally:
                await run_in_threadpool(ingest.close, close_timeout_s)

    routes = [
        Route(
            TRACES_PATH,
            receiver(
                ingest, max_body_bytes=max_body_bytes, busy_status=busy_status, inline_decode_bytes=max_body_bytes
            ),
            methods=["POST"],
        ),
        Route("/metrics", _ASGI(make_asgi_app(registry)), methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/health", healthz, methods=["GET"]),  # vLLM's and the router's name (kvlens up waits on it)
    ]
    return Starlette(routes=routes, lifespan=lifespan)
