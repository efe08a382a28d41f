"""OTLP/HTTP ``/v1/traces`` request bodies -> :class:`WireSpan` s: the
collector's receive path.

:func:`decode` checks a body exactly as :func:`exporters.collector.otlp.decode`
does (the same 413 / 415 / 400 answers, the same rejection reasons, the
resource's ``service.name`` copied into a span's attributes) but builds no
OpenTelemetry SDK objects: a :class:`WireSpan` carries only what the trace
store (:func:`kvtrace.store.write_spans`) and the span metrics
(:class:`exporters.metrics.PhaseMetricsProcessor`) read of a span, which
they read from it as from a ``ReadableSpan``. A third less decoding CPU
per span: at fleet rates the collector's CPU is the budget.

Pure functions, any thread; CPU only.
"""

from __future__ import annotations

from typing import NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from exporters.collector.otlp import DEFAULT_MAX_BYTES, checked, parse


def decode(
    body: bytes, content_type: str | None, encoding: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> list[WireSpan]:
    """The spans of one OTLP/HTTP ``/v1/traces`` request body as
    :class:`WireSpan` s; arguments and errors as :func:`exporters.collector.otlp.decode`."""
    return wire_spans_of(parse(body, content_type, encoding, max_bytes))


class SpanIds(NamedTuple):
    """A :class:`WireSpan`'s ``context`` / ``parent``: the ids as ints, the
    two fields of ``SpanContext`` the store and the metrics read."""

    trace_id: int
    span_id: int


class WireSpan:
    """A received span as the collector's writer and metrics read it: the
    ``ReadableSpan`` fields they use (``name``, ``context``, ``parent``,
    ``start_time``, ``end_time``, ``attributes``), nothing else, so
    :func:`kvtrace.store.write_spans` and ``PhaseMetricsProcessor.on_end``
    take it as they take an SDK span. ``attributes`` is a plain dict owned
    by the span."""

    __slots__ = ("name", "context", "parent", "start_time", "end_time", "attributes")

    def __init__(self, name: str, context: SpanIds, parent: SpanIds | None, start: int, end: int, attributes: dict):
        self.name, self.context, self.parent = name, context, parent
        self.start_time, self.end_time, self.attributes = start, end, attributes

    def __repr__(self) -> str:
        return f"WireSpan({self.name!r}, trace {self.context.trace_id:032x}, span {self.context.span_id:016x})"


def wire_spans_of(req: ExportTraceServiceRequest) -> list[WireSpan]:
    """Every span of a parsed request as a :class:`WireSpan`, checked and
    attributed as :func:`exporters.collector.otlp.checked` does (the same
    400s, the resource's ``service.name`` copied in); resources, scopes,
    kinds, status and trace state are not built (nothing the collector
    stores reads them): the collector's receive path."""
    out: list[WireSpan] = []
    append = out.append
    parents: dict[tuple, SpanIds] = {}
    frombytes = int.from_bytes
    for _, _, sp, a in checked(req):
        tid, pid = sp.trace_id, sp.parent_span_id
        trace_id = frombytes(tid, "big")
        parent = None
        if pid and any(pid):
            parent = parents.get((tid, pid))
            if parent is None:
                parent = parents[tid, pid] = SpanIds(trace_id, frombytes(pid, "big"))
        ids = SpanIds(trace_id, frombytes(sp.span_id, "big"))
        append(WireSpan(sp.name, ids, parent, sp.start_time_unix_nano, sp.end_time_unix_nano, a))
    return out
