"""The span builder: one :class:`kvrecord.events.Event` -> one OpenTelemetry span.

Runs on a recorder's background thread (:class:`kvrecord.recorder.Recorder`),
in the process that records or in its sidecar (:mod:`exporters.sidecar`),
never on a hot path. A ``span`` event becomes a child of its request's root
span: the trace id read out of the request id (:func:`ids.trace_id_for`, D's
request id joined to P's, :class:`ids.Joins`), the parent the root span id
derived from it (:func:`ids.root_span_id`). A ``root`` event becomes that
root span, with the derived ids pinned on the provider's id generator.
"""

from __future__ import annotations

from typing import Any, Mapping

from opentelemetry import trace as otel_trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from kvrecord import ids
from kvrecord import semconv as sc
from kvrecord.events import Event, Kind

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_ROOT = Kind.ROOT


class SpanBuilder:
    """Builds spans on ``tracer``, whose provider was built with ``id_generator``;
    every span carries ``base_attrs`` (mode, role, engine id). One thread."""

    def __init__(self, tracer, id_generator: ids.PinnedIdGenerator, base_attrs: Mapping[str, Any]) -> None:
        self.tracer = tracer
        self.ids = id_generator
        self.base_attrs = base_attrs
        self.joins = ids.Joins()  # D's request id -> P's

    def build(self, ev: Event) -> None:
        """Build and end the span of ``ev``. Raises on a malformed event (the
        recorder counts it lost and goes on)."""
        if ev.kind is _ROOT:
            self._root(ev)
        else:
            self._span(ev)

    def _attributes(self, request_id: str, outcome: str, attrs: dict | None) -> dict:
        a = dict(self.base_attrs)
        a[sc.ATTR_REQUEST_ID] = request_id
        a[sc.ATTR_OUTCOME] = sc.closed(outcome, sc.Outcome)
        if attrs:
            for k, v in attrs.items():
                if v is not None:
                    a[k] = v
        return a

    def _span(self, ev: Event) -> None:
        """A phase span: child of the request's root span (derived ids)."""
        phase, t0 = ev.phase, ev.start_ns
        name = phase.value if isinstance(phase, sc.Phase) else str(phase)
        a = self._attributes(ev.request_id, ev.outcome, ev.attrs)
        tid = ids.trace_id_for(self.joins.key(ev.request_id, a))
        ctx = otel_trace.set_span_in_context(NonRecordingSpan(SpanContext(tid, ids.root_span_id(tid), True, _SAMPLED)))
        _end(self.tracer.start_span(name, context=ctx, attributes=a, start_time=t0), a, t0, ev.end_ns)

    def _root(self, ev: Event) -> None:
        """The root span takes the derived root id, so P and D spans that
        never talked to the router are its children. Its parent is the
        caller's traceparent span when there was one (the SDK then takes the
        trace id from it); otherwise it is a root, and the pinned generator
        supplies the trace id too."""
        trace_hex, t0, parent_sid = ev.request_id, ev.start_ns, ev.parent_span_id
        tid = ids.trace_id_for(trace_hex)
        if parent_sid:
            ctx = otel_trace.set_span_in_context(NonRecordingSpan(SpanContext(tid, parent_sid, True, _SAMPLED)))
        else:
            ctx = Context()
        a = self._attributes(trace_hex, ev.outcome, ev.attrs)
        with self.ids.pin(span_id=ids.root_span_id(tid), trace_id=tid):
            span = self.tracer.start_span(sc.Phase.REQUEST.value, context=ctx, attributes=a, start_time=t0)
        _end(span, a, t0, ev.end_ns)


def _end(span, a: dict, t0: int, t1: int) -> None:
    if a[sc.ATTR_OUTCOME] != sc.Outcome.OK.value:
        span.set_status(Status(StatusCode.ERROR, a[sc.ATTR_OUTCOME]))
    span.end(end_time=max(t1, t0))
