"""OTLP/HTTP ``/v1/traces`` request bodies -> the OTel SDK's ``ReadableSpan`` s.

:func:`decode` takes one request body as it came off the wire (protobuf
``application/x-protobuf`` or OTLP-JSON ``application/json``, optionally
``Content-Encoding: gzip`` / ``deflate``) and returns its spans as
``opentelemetry.sdk.trace.ReadableSpan`` objects, the type a local SDK
pipeline hands its exporters: :func:`kvtrace.store.write_spans` and
:class:`exporters.metrics.PhaseMetricsProcessor` take one span type whether
the span was recorded in this process or came over OTLP from another host,
so spans that crossed the network land in the store exactly as a local
exporter writes them.

Errors raise :class:`OTLPError` with the HTTP status the OTLP/HTTP
specification asks for (415 unsupported content type or encoding, 413 too
large, 400 malformed: not retried by exporters) and a message naming the
problem; a request with one bad span is rejected whole.

Pure functions, any thread; CPU only (no I/O). The protobuf classes are the
``opentelemetry-proto`` ones; JSON goes through ``json_format.ParseDict``
after the OTLP-JSON hex ids are turned into the base64 that protobuf's JSON
mapping expects.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any, Iterator

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.status import Status, StatusCode

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
#: Default cap on a (decompressed) request body, bytes.
DEFAULT_MAX_BYTES = 16 * 1024 * 1024

#: ``Content-Encoding`` -> zlib ``wbits`` (gzip framing, zlib framing).
_ENCODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}
_TRACE_ID_LEN, _SPAN_ID_LEN = 16, 8


class OTLPError(Exception):
    """A request the receiver refuses. ``status``: the HTTP status to answer
    (400, 413, 415); ``reason``: the closed rejection label
    (``decode``, ``invalid_span``, ``too_large``, ``content_type``)."""

    _REASONS = {413: "too_large", 415: "content_type"}

    def __init__(self, status: int, message: str, reason: str | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.reason = reason or self._REASONS.get(self.status, "decode")


# ------------------------------------------------------------ request framing
def content_kind(content_type: str | None) -> str:
    """:data:`PROTOBUF` or :data:`JSON` for a ``Content-Type`` header value
    (parameters such as ``charset`` ignored, any case); 415 otherwise."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media in (PROTOBUF, JSON):
        return media
    shown = media or "none"
    raise OTLPError(415, f"unsupported Content-Type {shown!r}: OTLP/HTTP takes {PROTOBUF} or {JSON}")


def decompress(body: bytes, encoding: str | None, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """``body`` decoded per ``Content-Encoding`` (none, identity, gzip,
    deflate), never growing past ``max_bytes`` (413); a damaged stream is 400,
    an unknown encoding 415."""
    enc = (encoding or "").strip().lower()
    if enc in ("", "identity"):
        return body
    wbits = _ENCODINGS.get(enc)
    if wbits is None:
        raise OTLPError(415, f"unsupported Content-Encoding {enc!r}: use gzip, deflate or none")
    out = bytearray()
    rest = body
    try:
        while rest:
            d = zlib.decompressobj(wbits)
            out += d.decompress(rest, max_bytes + 1 - len(out))
            if len(out) > max_bytes:
                raise OTLPError(413, f"request body is larger than {max_bytes} bytes once decompressed ({enc})")
            if not d.eof:
                raise OTLPError(400, f"invalid {enc} body: truncated stream")
            rest = d.unused_data  # gzip allows several members back to back
    except zlib.error as e:
        raise OTLPError(400, f"invalid {enc} body: {e}") from None
    return bytes(out)


def decode(
    body: bytes, content_type: str | None, encoding: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> list[ReadableSpan]:
    """The spans of one OTLP/HTTP ``/v1/traces`` request body.

    ``content_type`` / ``encoding``: the request's ``Content-Type`` and
    ``Content-Encoding`` headers. ``max_bytes`` caps the decompressed body.
    Raises :class:`OTLPError` (415 content type or encoding, 413 too large,
    400 malformed body or a span without valid ids). Any thread; CPU only.
    (The collector takes :func:`collector.wire.decode`: the same
    checks, lighter spans.)
    """
    return spans_of(parse(body, content_type, encoding, max_bytes))


def parse(
    body: bytes, content_type: str | None, encoding: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> ExportTraceServiceRequest:
    """One request body (arguments as :func:`decode`) as the protobuf request,
    spans not yet checked; the :class:`OTLPError` s of :func:`decode` but 400 invalid_span."""
    kind = content_kind(content_type)
    raw = decompress(body, encoding, max_bytes)
    return parse_protobuf(raw) if kind == PROTOBUF else parse_json(raw)


def parse_protobuf(raw: bytes) -> ExportTraceServiceRequest:
    """A decompressed protobuf body as the request; 400 when it is not one."""
    try:
        return ExportTraceServiceRequest.FromString(raw)
    except (DecodeError, ValueError) as e:
        raise OTLPError(400, f"invalid OTLP protobuf: {e or 'cannot parse'} ({len(raw)} bytes)") from None


# ----------------------------------------------------------------- OTLP-JSON
def parse_json(raw: bytes) -> ExportTraceServiceRequest:
    """An OTLP-JSON body (hex ids, lowerCamelCase or proto field names,
    unknown fields ignored) as the protobuf request; 400 when it is not."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise OTLPError(400, f"invalid OTLP JSON: {e}") from None
    if not isinstance(doc, dict):
        raise OTLPError(400, f"invalid OTLP JSON: the body is a {type(doc).__name__}, not an object")
    _hex_ids_to_base64(doc)
    try:
        return json_format.ParseDict(doc, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError) as e:
        raise OTLPError(400, f"invalid OTLP JSON: {e}") from None


def _list(obj: Any, *keys: str) -> list:
    """The first of ``keys`` present in ``obj`` when it is a list, else []."""
    if isinstance(obj, dict):
        for k in keys:
            v = obj.get(k)
            if isinstance(v, list):
                return v
    return []


_ID_KEYS = (("traceId", "trace_id"), ("spanId", "span_id"), ("parentSpanId", "parent_span_id"))


def _hex_ids_to_base64(doc: dict) -> None:
    """Rewrite, in place, every span's and link's hex ids as base64 (what
    protobuf's JSON mapping reads for ``bytes``)."""
    index = 0
    for r, rs in enumerate(_list(doc, "resourceSpans", "resource_spans")):
        for s, ss in enumerate(_list(rs, "scopeSpans", "scope_spans")):
            for i, span in enumerate(_list(ss, "spans")):
                if isinstance(span, dict):
                    where = _where(index, span.get("name"), r, s, i)
                    _convert_ids(span, where)
                    for link in _list(span, "links"):
                        _convert_ids(link, where + " (a link)")
                index += 1


def _convert_ids(obj: Any, where: str) -> None:
    if not isinstance(obj, dict):
        return
    for keys in _ID_KEYS:
        for k in keys:
            v = obj.get(k)
            if isinstance(v, str):
                try:
                    obj[k] = base64.b64encode(bytes.fromhex(v)).decode("ascii")
                except ValueError:
                    raise OTLPError(
                        400, f"{where}: {k} {v[:40]!r} is not hex (OTLP JSON ids are hex strings)", "invalid_span"
                    ) from None


def _where(index: int, name: Any, r: int, s: int, i: int) -> str:
    shown = name if isinstance(name, str) else ""
    return f"span #{index} {shown!r} (resourceSpans[{r}].scopeSpans[{s}].spans[{i}])"


# ------------------------------------------------------------ proto -> spans
# Objects that take few values are built once and shared (all immutable), so
# a span costs its attributes, its SpanContext and the ReadableSpan; a parent
# SpanContext is built once per request for all the spans under it (a
# trace's spans share their root). An SDK exports only the spans it sampled,
# and the Python SDK's encoder leaves the W3C flag bits of ``Span.flags`` at
# 0, so every received span is marked sampled (a pipeline that filters on it,
# as the batch processors do, would otherwise drop it) on top of the flags
# the sender set.
_TRACE_FLAGS = tuple(TraceFlags(i | TraceFlags.SAMPLED) for i in range(256))
_PARENT_IS_REMOTE = 0x200  # SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_INTERNAL = SpanKind.INTERNAL
_KINDS = {1: _INTERNAL, 2: SpanKind.SERVER, 3: SpanKind.CLIENT, 4: SpanKind.PRODUCER, 5: SpanKind.CONSUMER}
_STATUS = {0: Status(StatusCode.UNSET), 1: Status(StatusCode.OK), 2: Status(StatusCode.ERROR)}


def checked(req: ExportTraceServiceRequest) -> Iterator[tuple[Any, Any, Any, dict]]:
    """(resource spans, scope spans, span, attributes) for every span of a
    parsed request, in order: each span's ids checked (400 ``invalid_span``
    naming the first bad one), its attributes decoded, the resource's
    ``service.name`` copied in where the span has none (so the store keeps
    where a span came from). Both decoders walk a request with this."""
    index = 0
    for r, rs in enumerate(req.resource_spans):
        service = attributes_of(rs.resource.attributes).get("service.name")
        for s, ss in enumerate(rs.scope_spans):
            for i, sp in enumerate(ss.spans):
                problem = _id_problem(sp.trace_id, sp.span_id, sp.parent_span_id)
                if problem:
                    raise OTLPError(400, f"{_where(index, sp.name, r, s, i)}: {problem}", "invalid_span")
                a = attributes_of(sp.attributes)
                if service is not None and "service.name" not in a:
                    a["service.name"] = service
                yield rs, ss, sp, a
                index += 1


def spans_of(req: ExportTraceServiceRequest) -> list[ReadableSpan]:
    """Every span of a parsed request as a ``ReadableSpan``, checked as
    :func:`checked` says: resource (one ``Resource`` per ``ResourceSpans``),
    scope, kind, status, trace state. Events and links are not decoded
    (nothing in kvlens reads them). Attribute values: str, bool, int, float,
    tuples for arrays, dicts for kvlists, hex str for bytes. The spans are
    new objects, owned by the caller."""
    out: list[ReadableSpan] = []
    append = out.append
    parents: dict[tuple, SpanContext] = {}
    last_rs = last_ss = resource = scope = None
    for rs, ss, sp, a in checked(req):
        if rs is not last_rs:
            last_rs, resource = rs, Resource(attributes_of(rs.resource.attributes), rs.schema_url)
        if ss is not last_ss:
            last_ss, scope = ss, InstrumentationScope(ss.scope.name, ss.scope.version, ss.schema_url)
        tid, sid, pid = sp.trace_id, sp.span_id, sp.parent_span_id
        flags = sp.flags & 0x3FF
        trace_flags = _TRACE_FLAGS[flags & 0xFF]
        trace_id = int.from_bytes(tid, "big")
        parent = None
        if pid and any(pid):
            parent = parents.get((tid, pid, flags))
            if parent is None:
                parent = parents[tid, pid, flags] = _parent(trace_id, pid, flags, trace_flags)
        state = TraceState.from_header([sp.trace_state]) if sp.trace_state else None
        ctx = SpanContext(trace_id, int.from_bytes(sid, "big"), False, trace_flags, state)
        # positional arguments: ~1 us per span less than keywords
        append(
            ReadableSpan(
                sp.name,
                ctx,
                parent,
                resource,
                a,
                (),  # events
                (),  # links
                _KINDS.get(sp.kind, _INTERNAL),
                None,  # instrumentation_info (deprecated for the scope)
                _status(sp.status),
                sp.start_time_unix_nano,
                sp.end_time_unix_nano,
                scope,
            )
        )
    return out


def _parent(trace_id: int, pid: bytes, flags: int, trace_flags: TraceFlags) -> SpanContext:
    return SpanContext(trace_id, int.from_bytes(pid, "big"), bool(flags & _PARENT_IS_REMOTE), trace_flags)


def _status(status) -> Status:
    """A protobuf ``Status`` as the SDK's (which keeps a description only on errors)."""
    code = status.code
    if code == 2 and status.message:
        return Status(StatusCode.ERROR, status.message)
    return _STATUS.get(code) or _STATUS[0]


def _id_problem(tid: bytes, sid: bytes, pid: bytes) -> str | None:
    """What is wrong with a span's ids, or None. An all-zero parent id is
    read as no parent (some exporters send one for root spans)."""
    if len(tid) != _TRACE_ID_LEN:
        return "missing trace id" if not tid else f"trace id has {len(tid)} bytes, not {_TRACE_ID_LEN}"
    if len(sid) != _SPAN_ID_LEN:
        return "missing span id" if not sid else f"span id has {len(sid)} bytes, not {_SPAN_ID_LEN}"
    if not any(tid):
        return "trace id is all zeros (invalid)"
    if not any(sid):
        return "span id is all zeros (invalid)"
    if pid and len(pid) != _SPAN_ID_LEN:
        return f"parent span id has {len(pid)} bytes, not {_SPAN_ID_LEN}"
    return None


# ------------------------------------------------------------- AnyValue
def attributes_of(kvs) -> dict:
    """A repeated ``KeyValue`` as a dict (later keys win, as in the SDK);
    keys whose value is empty are left out (the SDK never records None)."""
    out: dict = {}
    for kv in kvs:
        # the scalar kinds inline (a call less per attribute: most of them)
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "string_value":
            out[kv.key] = v.string_value
        elif kind == "int_value":
            out[kv.key] = v.int_value
        elif kind == "double_value":
            out[kv.key] = v.double_value
        elif kind == "bool_value":
            out[kv.key] = v.bool_value
        else:
            v = value_of(v)
            if v is not None:
                out[kv.key] = v
    return out


def value_of(v) -> Any:
    """An ``AnyValue`` as Python: str, bool, int, float; arrays as tuples (as
    SDK attributes hold them), kvlists as JSON-able dicts, bytes as hex."""
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return v.string_value
    if kind == "int_value":
        return v.int_value
    if kind == "double_value":
        return v.double_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "array_value":
        return tuple(value_of(x) for x in v.array_value.values)
    if kind == "kvlist_value":
        return {kv.key: _jsonable(value_of(kv.value)) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return None  # empty, or a profiles-only string-table index


def _jsonable(v: Any) -> Any:
    return [_jsonable(x) for x in v] if isinstance(v, tuple) else v
