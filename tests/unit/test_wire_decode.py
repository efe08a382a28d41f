"""The collector's lean protobuf decoder (:func:`collector.wire.decode`)
against the reference (:func:`collector.otlp.decode`, SDK
ReadableSpans, and the reference walk :func:`wire.wire_spans_of`): the same
spans, attributes (values, order), ids and the same errors, on bodies built
field by field with the real protobuf types, damaged bodies included."""

from __future__ import annotations

import json
import random

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1 import common_pb2

from collector import otlp, wire

PB = "application/x-protobuf"
TID, SID, PID = bytes(range(1, 17)), b"\x02" * 8, b"\x03" * 8


def _kv(key, **value):
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(**value))


def _any(**value):
    return common_pb2.AnyValue(**value)


def _request(*resources) -> ExportTraceServiceRequest:
    """``resources``: (resource attributes, [scope: [span fields dict]])."""
    req = ExportTraceServiceRequest()
    for attrs, scopes in resources:
        rs = req.resource_spans.add()
        rs.resource.attributes.extend(attrs)
        for spans in scopes:
            ss = rs.scope_spans.add()
            ss.scope.name = "kvlens"
            for fields in spans:
                fields = {"trace_id": TID, "span_id": SID, "start_time_unix_nano": 5, "end_time_unix_nano": 9, **fields}
                ss.spans.add(**fields)
    return req


def _outcome(decode, body: bytes, kind: str = PB):
    """What a decoder answers: its spans as comparable tuples, or its error."""
    try:
        spans = decode(body, kind)
    except otlp.OTLPError as e:
        return ("error", e.status, e.reason, e.message)
    return [
        (
            s.name,
            s.context.trace_id,
            s.context.span_id,
            s.parent.trace_id if s.parent else None,
            s.parent.span_id if s.parent else None,
            s.start_time,
            s.end_time,
            list(dict(s.attributes).items()),  # the order too: the store writes them as given
        )
        for s in spans
    ]


def _same(body: bytes, cache: wire.AttributeCache | None = None, kind: str = PB):
    """The lean decoder answers as the reference (and twice: from its cache);
    its hex ids are the ints' hex. Returns the outcome."""
    cache = cache if cache is not None else wire.AttributeCache()
    ref = _outcome(otlp.decode, body, kind)
    for _ in range(2):
        assert _outcome(lambda b, k: wire.decode(b, k, cache=cache), body, kind) == ref
    if isinstance(ref, list):
        for s in wire.decode(body, kind, cache=cache):
            assert (s.trace_id, s.span_id) == s.context and type(s.context) is wire.SpanIds
            assert s.trace_hex == format(s.context.trace_id, "032x")
            assert s.span_hex == format(s.context.span_id, "016x")
            assert s.parent_hex == (format(s.parent.span_id, "016x") if s.parent else None)
    return ref


def _every_kind() -> list:
    kvlist = common_pb2.KeyValueList(
        values=[
            _kv("n", double_value=1.5),
            _kv("xs", array_value=common_pb2.ArrayValue(values=[_any(bool_value=True)])),
        ]
    )
    return [
        _kv("s", string_value="x"),
        _kv("s0", string_value=""),
        _kv("i", int_value=-7),
        _kv("i0", int_value=0),
        _kv("big", int_value=2**63 - 1),
        _kv("d", double_value=0.25),
        _kv("nan", double_value=float("inf")),
        _kv("b", bool_value=False),
        _kv("a", array_value=common_pb2.ArrayValue(values=[_any(int_value=1), _any(string_value="b")])),
        _kv("a0", array_value=common_pb2.ArrayValue()),
        _kv("k", kvlist_value=kvlist),
        _kv("raw", bytes_value=b"\xca\xfe"),
        common_pb2.KeyValue(key="empty"),
        _kv("ü ключ", string_value="värde ✓"),
    ]


def test_every_value_kind_decodes_as_the_reference():
    req = _request(([_kv("service.name", string_value="svc")], [[{"name": "all", "attributes": _every_kind()}]]))
    (span,) = _same(req.SerializeToString())
    attrs = dict(span[-1])
    assert attrs["a"] == (1, "b") and attrs["k"] == {"n": 1.5, "xs": [True]} and attrs["raw"] == "cafe"
    assert "empty" not in attrs and attrs["service.name"] == "svc"


def test_duplicate_keys_later_wins_and_empty_values_are_left_out():
    attrs = [
        _kv("k", string_value="first"),
        _kv("x", int_value=1),
        _kv("k", string_value="second"),
        common_pb2.KeyValue(key="x"),  # empty: the earlier value stays
        common_pb2.KeyValue(key="only-empty"),
    ]
    (span,) = _same(_request(([], [[{"name": "dup", "attributes": attrs}]])).SerializeToString())
    assert span[-1] == [("k", "second"), ("x", 1)]


def test_service_name_of_the_resource_unless_the_span_has_one():
    res = [_kv("service.name", string_value="from-resource"), _kv("host", string_value="h")]
    spans = [
        {"name": "own", "attributes": [_kv("service.name", string_value="from-span")]},
        {"name": "inherits", "attributes": [_kv("a", int_value=1)]},
        {"name": "empty-own", "attributes": [common_pb2.KeyValue(key="service.name")]},
    ]
    out = _same(_request((res, [spans]), ([], [spans])).SerializeToString())
    got = {(i, s[0]): dict(s[-1]).get("service.name") for i, s in enumerate(out)}
    assert got == {
        (0, "own"): "from-span",
        (1, "inherits"): "from-resource",
        (2, "empty-own"): "from-resource",
        (3, "own"): "from-span",
        (4, "inherits"): None,  # a resource without a service name
        (5, "empty-own"): None,
    }


def test_resources_scopes_parents_and_traces_mix():
    t2 = b"\x09" * 16
    scope_a = [
        {"name": "root", "parent_span_id": b"\x00" * 8},
        {"name": "child", "parent_span_id": PID, "span_id": b"\x04" * 8},
        {"name": "other-trace", "trace_id": t2, "parent_span_id": PID, "span_id": b"\x05" * 8},
    ]
    scope_b = [{"name": "again", "parent_span_id": PID, "span_id": b"\x06" * 8, "start_time_unix_nano": 2**64 - 1}]
    req = _request(([_kv("service.name", string_value="p")], [scope_a, scope_b]), ([], []), ([], [[]]))
    out = _same(req.SerializeToString())
    assert [s[0] for s in out] == ["root", "child", "other-trace", "again"]
    assert out[0][3] is None and out[2][3:5] == (int.from_bytes(t2, "big"), int.from_bytes(PID, "big"))
    assert _same(ExportTraceServiceRequest().SerializeToString()) == []


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("trace_id", b"", "missing trace id"),
        ("trace_id", b"\x01" * 15, "trace id has 15 bytes"),
        ("trace_id", b"\x00" * 16, "trace id is all zeros"),
        ("span_id", b"", "missing span id"),
        ("span_id", b"\x01" * 4, "span id has 4 bytes"),
        ("span_id", b"\x00" * 8, "span id is all zeros"),
        ("parent_span_id", b"\x01" * 3, "parent span id has 3 bytes"),
    ],
)
def test_bad_ids_are_the_reference_400(field, value, words):
    good = {"name": "ok", "attributes": [_kv("a", int_value=1)]}
    bad = {"name": "bad", field: value}
    req = _request(([_kv("service.name", string_value="s")], [[good, good, bad]]))
    err = _same(req.SerializeToString())
    assert err[:3] == ("error", 400, "invalid_span") and words in err[3] and "span #2 'bad'" in err[3]


def test_a_bad_attribute_after_a_bad_id_is_the_parse_error_as_in_the_reference():
    bad_id = _request(
        ([], [[{"name": "bad", "span_id": b""}, {"name": "late", "attributes": [_kv("a", int_value=1)]}]])
    )
    body = bad_id.SerializeToString()
    kv = _kv("a", int_value=1).SerializeToString()
    broken = kv.replace(b"\x0a\x01a", b"\x0a\x01\xff")  # the key is not UTF-8: the real parser refuses it
    err = _same(body.replace(kv, broken))
    assert err[:3] == ("error", 400, "decode") and "invalid OTLP protobuf" in err[3]


def test_the_cache_is_bounded_and_results_do_not_change_when_it_empties():
    cache = wire.AttributeCache(max_entries=5)
    for i in range(6):
        spans = [{"name": f"s{j}", "attributes": _every_kind()[: 3 + j] + [_kv("i", int_value=i)]} for j in range(4)]
        _same(_request(([_kv("service.name", string_value=f"svc{i}")], [spans])).SerializeToString(), cache)
        assert len(cache) + len(cache.empty) <= 5


def test_kvlist_values_are_not_shared_between_spans():
    kvl = _kv("k", kvlist_value=common_pb2.KeyValueList(values=[_kv("n", int_value=1)]))
    arr = _kv("a", array_value=common_pb2.ArrayValue(values=[_any(kvlist_value=common_pb2.KeyValueList())]))
    req = _request(([], [[{"name": "one", "attributes": [kvl, arr]}, {"name": "two", "attributes": [kvl, arr]}]]))
    cache = wire.AttributeCache()
    one, two = wire.decode(req.SerializeToString(), PB, cache=cache)
    one.attributes["k"]["n"] = 99
    one.attributes["a"][0]["x"] = 1
    assert two.attributes == {"k": {"n": 1}, "a": ({},)}
    one.attributes["new"] = 1  # the span owns its dict
    assert "new" not in wire.decode(req.SerializeToString(), PB, cache=cache)[0].attributes


def _nested(levels: int) -> bytes:
    """A serialized KeyValue whose value is ``levels`` arrays deep (built
    as bytes: the protobuf API itself refuses to build past its depth limit)."""

    def ld(tag: int, payload: bytes) -> bytes:
        n, head = len(payload), bytearray([tag])
        while n > 0x7F:
            head.append(n & 0x7F | 0x80)
            n >>= 7
        return bytes(head + bytes([n])) + payload

    v = b"\x18\x01"
    for _ in range(levels):
        v = ld(0x2A, ld(0x0A, v))  # AnyValue.array_value -> ArrayValue.values
    return ld(0x4A, b"\x0a\x01k" + ld(0x12, v))  # Span.attributes


@pytest.mark.parametrize("levels", [3, 45, 46, 47, 48, 49, 50])
@pytest.mark.parametrize("where", ["span", "resource"])
def test_deep_attributes_meet_the_parsers_depth_limit_where_the_reference_does(levels, where):
    span = _request(([], [[{"name": "deep"}]])).resource_spans[0].scope_spans[0].spans[0].SerializeToString()
    kv = _nested(levels)  # a Span.attributes field (9); Resource.attributes is field 1
    if where == "span":
        ss = b"\x12" + _varint(len(span) + len(kv)) + span + kv
        rs = b"\x12" + _varint(len(ss)) + ss
    else:
        res = b"\x0a" + kv[1:]
        ss = b"\x12" + _varint(len(span)) + span
        rs = b"\x0a" + _varint(len(res)) + res + b"\x12" + _varint(len(ss)) + ss
    _same(b"\x0a" + _varint(len(rs)) + rs)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def test_long_and_odd_attributes():
    long = "x" * 300
    kvs = [_kv("long", string_value=long), _kv("ints", array_value=common_pb2.ArrayValue(values=[_any(int_value=-1)]))]
    req = _request(([_kv("service.name", string_value=long)], [[{"name": "l", "attributes": kvs}]]))
    (span,) = _same(req.SerializeToString())
    assert dict(span[-1])["long"] == long
    body = req.SerializeToString()
    odd = _kv("z", int_value=3).SerializeToString()
    for extra in (
        b"\x0c",
        b"\x0b\x0c",
        b"\x08\x01",
        b"\x1a\x02\xff\xfe",
        b"\x0a\x01y",
    ):  # groups, unknown fields, a second key
        kv = odd + extra
        span_b = req.resource_spans[0].scope_spans[0].spans[0].SerializeToString() + b"\x4a" + _varint(len(kv)) + kv
        rs = b"\x0a" + _varint(len(req.resource_spans[0].resource.SerializeToString()))
        rs += req.resource_spans[0].resource.SerializeToString()
        ss = b"\x12" + _varint(len(span_b)) + span_b
        rs += b"\x12" + _varint(len(ss)) + ss
        _same(b"\x0a" + _varint(len(rs)) + rs)
    assert body  # the unchanged body still decodes above


def test_damaged_bodies_answer_as_the_reference():
    rng = random.Random(7)
    spans = [
        {
            "name": f"s{i}",
            "parent_span_id": PID if i else b"",
            "span_id": bytes([i + 1]) * 8,
            "attributes": _every_kind(),
        }
        for i in range(3)
    ]
    body = _request(([_kv("service.name", string_value="svc")], [spans])).SerializeToString()
    cache = wire.AttributeCache()
    kinds = set()
    for _ in range(400):
        b = bytearray(body)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(b))
            op = rng.randrange(3)
            if op == 0:
                b[i] = rng.randrange(256)
            elif op == 1:
                del b[i]
            else:
                b.insert(i, rng.randrange(256))
        out = _same(bytes(b[: rng.choice((len(b), rng.randrange(len(b) + 1)))]), cache)
        kinds.add("spans" if isinstance(out, list) else "error")
    assert kinds == {"error", "spans"}  # both roads taken


def test_json_bodies_take_the_reference_walk():
    req = _request(([_kv("service.name", string_value="svc")], [[{"name": "j", "attributes": _every_kind()}]]))
    doc = json_format.MessageToDict(req)
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["traceId"], span["spanId"] = TID.hex(), SID.hex()
    (ref,) = _same(json.dumps(doc).encode(), kind="application/json")
    (pb,) = _same(req.SerializeToString())
    assert ref == pb
    span["spanId"] = "zz"
    assert _same(json.dumps(doc).encode(), kind="application/json")[:3] == ("error", 400, "invalid_span")
