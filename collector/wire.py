"""OTLP/HTTP ``/v1/traces`` request bodies -> :class:`WireSpan` s: the
collector's receive path.

:func:`decode` checks a body exactly as :func:`collector.otlp.decode`
does (the same 413 / 415 / 400 answers, the same rejection reasons, the
resource's ``service.name`` copied into a span's attributes) but builds no
OpenTelemetry SDK objects: a :class:`WireSpan` carries only what the trace
store (:func:`kvtrace.store.write_spans`) and the span metrics
(:class:`exporters.metrics.PhaseMetricsProcessor`) read of a span, which
they read from it as from a ``ReadableSpan``. At fleet rates the
collector's CPU is the budget, so a protobuf body takes a lean road:

* it is parsed as :data:`LEAN_REQUEST`, OTLP's own schema but for
  ``Span.attributes`` and ``Resource.attributes`` declared ``repeated
  bytes`` (a length-delimited field reads the same either way): every
  other field is checked by the parser just as the real type checks it,
  and each attribute arrives as its serialized ``KeyValue``;
* an attribute is decoded once per distinct serialized ``KeyValue``
  (:class:`AttributeCache`): kvlens spans repeat most of theirs (mode,
  role, engine, outcome, block counts, ...), and reading a ``KeyValue``
  through the protobuf wrappers costs several times a dict look-up;
* anything the lean road cannot answer as the reference walk would (a body
  or an attribute the parser rejects, a span with bad ids) is decoded again
  by the reference walk (:func:`wire_spans_of` over the real type), which
  raises the error: bad input costs more, good input less.

OTLP-JSON bodies take the reference walk. Pure functions, any thread; CPU only.
"""

from __future__ import annotations

from operator import attrgetter
from sys import intern
from typing import Iterable, NamedTuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from collector.otlp import (
    DEFAULT_MAX_BYTES,
    PROTOBUF,
    checked,
    content_kind,
    decompress,
    parse_json,
    parse_protobuf,
    value_of,
)


def decode(
    body: bytes,
    content_type: str | None,
    encoding: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    cache: AttributeCache | None = None,
) -> list[WireSpan]:
    """The spans of one OTLP/HTTP ``/v1/traces`` request body as
    :class:`WireSpan` s; arguments and errors as :func:`collector.otlp.decode`.
    ``cache``: where decoded attributes are kept (default: the process's)."""
    kind = content_kind(content_type)
    raw = decompress(body, encoding, max_bytes)
    if kind != PROTOBUF:
        return wire_spans_of(parse_json(raw))
    try:
        return lean_spans_of(LEAN_REQUEST.FromString(raw), ATTRIBUTES if cache is None else cache)
    except (DecodeError, ValueError, _Refer):
        return wire_spans_of(parse_protobuf(raw))  # the reference's spans, or its error


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
    by the span. ``context`` is built when read (a new :class:`SpanIds`
    each time: read it once): an object kept per span costs the garbage
    collector more than the read. Beyond ``ReadableSpan``: ``trace_id`` and
    ``span_id`` (ints, what ``context`` holds) and the ids as the store
    writes them (lower-case hex, what ``format_trace_id`` /
    ``format_span_id`` give), ``trace_hex`` (32 digits), ``span_hex`` (16)
    and ``parent_hex`` (16, or None without a parent), taken from the wire
    bytes, so a reader of a WireSpan need not format the ints again."""

    __slots__ = (
        "name",
        "trace_id",
        "span_id",
        "parent",
        "start_time",
        "end_time",
        "attributes",
        "trace_hex",
        "span_hex",
        "parent_hex",
    )

    def __init__(
        self,
        name: str,
        trace_id: int,
        span_id: int,
        parent: SpanIds | None,
        start: int,
        end: int,
        attributes: dict,
        trace_hex: str,
        span_hex: str,
        parent_hex: str | None,
    ):
        self.name, self.trace_id, self.span_id, self.parent = name, trace_id, span_id, parent
        self.start_time, self.end_time, self.attributes = start, end, attributes
        self.trace_hex, self.span_hex, self.parent_hex = trace_hex, span_hex, parent_hex

    @property
    def context(self) -> SpanIds:
        return SpanIds(self.trace_id, self.span_id)

    def __repr__(self) -> str:
        return f"WireSpan({self.name!r}, trace {self.trace_hex}, span {self.span_hex})"


def wire_spans_of(req: ExportTraceServiceRequest) -> list[WireSpan]:
    """Every span of a parsed request as a :class:`WireSpan`, checked and
    attributed as :func:`collector.otlp.checked` does (the same
    400s, the resource's ``service.name`` copied in); resources, scopes,
    kinds, status and trace state are not built (nothing the collector
    stores reads them): the reference :func:`lean_spans_of` answers as."""
    out: list[WireSpan] = []
    append = out.append
    parents: dict[tuple, SpanIds] = {}
    frombytes = int.from_bytes
    for _, _, sp, a in checked(req):
        tid, pid = sp.trace_id, sp.parent_span_id
        trace_id = frombytes(tid, "big")
        parent = phex = None
        if pid and any(pid):
            phex = pid.hex()
            parent = parents.get((tid, pid))
            if parent is None:
                parent = parents[tid, pid] = SpanIds(trace_id, frombytes(pid, "big"))
        append(
            WireSpan(
                sp.name,
                trace_id,
                frombytes(sp.span_id, "big"),
                parent,
                sp.start_time_unix_nano,
                sp.end_time_unix_nano,
                a,
                tid.hex(),
                sp.span_id.hex(),
                phex,
            )
        )
    return out


# ------------------------------------------------------------- the lean road
class _Refer(Exception):
    """Raised inside :func:`lean_spans_of`: the reference walk must answer."""


#: Attribute fields that :data:`LEAN_REQUEST` keeps serialized: (package, message).
_RAW_ATTRIBUTES = {("opentelemetry.proto.trace.v1", "Span"), ("opentelemetry.proto.resource.v1", "Resource")}


def _files(fd, seen: set) -> Iterable:
    """``fd`` and the files it imports, each after those it imports."""
    for dep in fd.dependencies:
        if dep.name not in seen:
            yield from _files(dep, seen)
    seen.add(fd.name)
    yield fd


def _lean_request_class() -> type:
    """The request type of :data:`LEAN_REQUEST`: copies of the installed
    OTLP files, in a pool of their own (same names, so a parse error reads
    as the real type's), with the attributes of :data:`_RAW_ATTRIBUTES` as bytes."""
    pool = descriptor_pool.DescriptorPool()
    for fd in _files(trace_service_pb2.DESCRIPTOR, set()):
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        for msg in proto.message_type:
            if (proto.package, msg.name) in _RAW_ATTRIBUTES:
                for field in msg.field:
                    if field.name == "attributes":
                        field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                        field.ClearField("type_name")
        pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(ExportTraceServiceRequest.DESCRIPTOR.full_name))


#: ``ExportTraceServiceRequest`` whose span and resource attributes are serialized ``KeyValue`` s.
LEAN_REQUEST = _lean_request_class()

_KeyValue = KeyValue.FromString
_SCALARS = frozenset(("string_value", "int_value", "double_value", "bool_value"))
#: A ``KeyValue`` this long or longer could nest deep enough to meet the
#: parser's depth limit (100 messages deep, counted from the request; 2+
#: bytes a level), which a ``KeyValue`` parsed alone meets 4 levels later
#: than one inside a span: those are parsed inside a request (:func:`_span_attribute`).
_LONG_KEYVALUE = 160


class AttributeCache(dict):
    """Serialized ``KeyValue`` -> its (key, value) as the reference decodes
    it (:func:`collector.otlp.value_of`), for the attributes with
    a value, so ``dict(map(cache.__getitem__, raws))`` is a span's
    attributes; a ``KeyValue`` not held yet is decoded on the look-up
    (``__missing__``), one with an empty value raises ``KeyError`` (a span
    leaves it out: :meth:`attributes`). At most ``max_entries`` kept (then
    emptied: no bookkeeping per hit, and the values that repeat come back at
    once). Any thread: plain dict reads and writes, atomic under the GIL.
    Mutable values (kvlists) are not kept: each span gets its own."""

    def __init__(self, max_entries: int = 16384):
        super().__init__()
        self.max_entries = max_entries
        #: key, None of the attributes whose value is empty
        self.empty: dict[bytes, tuple] = {}

    def __missing__(self, raw: bytes) -> tuple:
        kv = self.empty.get(raw) or self.decode(raw)
        if kv[1] is None:
            raise KeyError(raw)
        return kv

    def attributes(self, raws: Iterable[bytes]) -> dict:
        """The attributes of serialized ``KeyValue`` s as
        :func:`collector.otlp.attributes_of` reads them (later
        keys win, empty values left out), through the cache."""
        out: dict = {}
        get, empty = self.get, self.empty
        for raw in raws:
            kv = get(raw) or empty.get(raw) or self.decode(raw)
            if kv[1] is not None:
                out[kv[0]] = kv[1]
        return out

    def decode(self, raw: bytes) -> tuple:
        """(key, value) of one serialized ``KeyValue``, value None when
        empty, as :func:`~collector.otlp.attributes_of` reads it; kept."""
        kv = _span_attribute(raw) if len(raw) >= _LONG_KEYVALUE else _KeyValue(raw)
        v = kv.value
        kind = v.WhichOneof("value")
        if kind in _SCALARS:  # most: one call less
            value = getattr(v, kind)
        else:
            value = value_of(v)
            if not _immutable(value):
                return kv.key, value
        if len(self) + len(self.empty) >= self.max_entries:
            self.clear()
            self.empty.clear()
        # one str per key for all spans (interned: the readers' literals match it by identity)
        pair = (self.empty if value is None else self)[raw] = (intern(kv.key), value)
        return pair


def _span_attribute(raw: bytes):
    """A serialized ``KeyValue`` parsed as the real request parses it as a
    span's attribute (the deepest place the collector reads one)."""
    lean = LEAN_REQUEST()
    lean.resource_spans.add().scope_spans.add().spans.add().attributes.append(raw)
    req = ExportTraceServiceRequest.FromString(lean.SerializeToString())
    return req.resource_spans[0].scope_spans[0].spans[0].attributes[0]


def _immutable(v) -> bool:
    return all(map(_immutable, v)) if type(v) is tuple else type(v) is not dict


#: The process's attribute cache (a few MB at most).
ATTRIBUTES = AttributeCache()
_Z8, _Z16 = bytes(8), bytes(16)
#: What a span gives: one C call for its fields
_SPAN_FIELDS = attrgetter(
    "trace_id", "span_id", "parent_span_id", "attributes", "name", "start_time_unix_nano", "end_time_unix_nano"
)


def lean_spans_of(req, cache: AttributeCache) -> list[WireSpan]:
    """Every span of a :data:`LEAN_REQUEST` as :func:`wire_spans_of` makes
    them of the same body parsed as the real type; :class:`_Refer` (or the
    parser's ``DecodeError``) where that walk would raise."""
    out: list[WireSpan] = []
    append = out.append
    # the ids a span refers to, checked once: a trace's spans travel together, its root is most spans' parent
    traces: dict[bytes, tuple] = {}  # trace id -> (int, hex)
    parents: dict[bytes, tuple] = {_Z8: (None, None)}  # parent id -> (SpanIds, hex), or Nones: no parent
    frombytes, new = int.from_bytes, tuple.__new__  # SpanIds(...) runs a Python __new__: twice the time
    known, attributes = cache.__getitem__, cache.attributes
    for rs in req.resource_spans:
        service = attributes(rs.resource.attributes[:]).get("service.name")
        for ss in rs.scope_spans:
            for tid, sid, pid, raws, name, start, end in map(_SPAN_FIELDS, ss.spans):
                t = traces.get(tid)
                if t is None:
                    if len(tid) != 16 or tid == _Z16:
                        raise _Refer  # otlp._id_problem's cases, in other words: the reference raises them
                    t = traces[tid] = (frombytes(tid, "big"), tid.hex())
                if len(sid) != 8 or sid == _Z8:
                    raise _Refer
                parent = phex = None
                if pid:
                    p = parents.get(pid)
                    if p is None or (p[0] is not None and p[0][0] != t[0]):
                        if len(pid) != 8:
                            raise _Refer
                        p = parents[pid] = (new(SpanIds, (t[0], frombytes(pid, "big"))), pid.hex())
                    parent, phex = p
                try:
                    a = dict(map(known, raws[:]))  # no attribute empty: most spans
                except KeyError:
                    a = attributes(raws[:])
                if service is not None and "service.name" not in a:
                    a["service.name"] = service
                append(WireSpan(name, t[0], frombytes(sid, "big"), parent, start, end, a, t[1], sid.hex(), phex))
    return out
