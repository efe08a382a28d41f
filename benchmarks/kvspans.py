"""kvlens-shaped spans for load generators: what the router, P and D of a
(P, D) pair emit for one push or one pull request, as OTel ``ReadableSpan``
s ready for ``encode_spans`` (shared by ``bench_collector.py``,
``bench_fleetsim.py`` and ``tests/unit/test_fleetsim.py``).

The shapes follow the recorders (``instrumented_connector``, the router):
span names and attributes as they record them, every span a child of the
router's ``request`` root span (its id derived from the trace id, as P and
D derive it, :func:`kvrecord.ids.root_span_id`), P's and D's request ids
carrying the trace id, D's pull spans joined to P's request id, each
process with its own resource (``service.name``, ``kvlens.role``,
``service.instance.id``) and scope ``kvlens``.

Clocks: every timestamp is a true time on P's clock (the router's agrees,
docs/phases.md) except D's, which carry the pair's injected offset
``theta`` (D's clock minus P's). Each request has both clock crossings of
its mode (:data:`kvrecord.semconv.CROSSINGS`), with a one-way latency of
``NET_US`` +- jitter, so the store's bounds must contain ``theta``.
"""

from __future__ import annotations

import random
import struct
from typing import NamedTuple

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from kvrecord import semconv as sc
from kvrecord.ids import root_span_id

US = 1_000
#: One-way message latency between P and D (us), jittered per message.
NET_US = 300
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)
_SCOPE = InstrumentationScope("kvlens")
_INTERNAL = SpanKind.INTERNAL
_XFER_ATTRS = (sc.ATTR_BLOCKS, sc.ATTR_REMOTE_ENGINE_ID, sc.ATTR_REMOTE_RANK, sc.ATTR_REMOTE_RANKS)


class Proc(NamedTuple):
    """One exporting process: ``role`` and its index (pair k, or router r)."""

    role: str
    index: int


def _resource(role: str, engine: str | None) -> Resource:
    # as exporters.pipeline.provider_factory builds it
    attrs = {"service.name": f"kvlens-{role}", "kvlens.role": role}
    if engine:
        attrs["service.instance.id"] = engine
    return Resource.create(attrs)


class Fleet:
    """``pairs`` (P, D) pairs (engines ``p<k>`` / ``d<k>``) behind ``routers``
    routers; pair k's D clock runs ``offsets_ns[k]`` ahead of its P's, drawn
    uniformly from +-``spread_ms`` (seeded; ``spread_ms=0``: synchronised)."""

    def __init__(self, pairs: int, routers: int = 1, spread_ms: float = 50.0, seed: int = 1) -> None:
        if pairs < 1 or routers < 1:
            raise ValueError(f"need at least one pair and one router, got {pairs} pairs, {routers} routers")
        self.pairs, self.routers = pairs, routers
        self.rng = random.Random(seed)
        self.offsets_ns = [int(self.rng.uniform(-spread_ms, spread_ms) * 1e6) for _ in range(pairs)]
        self.resources = {Proc("router", r): _resource("router", None) for r in range(routers)}
        for k in range(pairs):
            self.resources[Proc("prefill", k)] = _resource("prefill", f"p{k}")
            self.resources[Proc("decode", k)] = _resource("decode", f"d{k}")

    def request(self, base_ns: int, pair: int, mode: str, router: int = 0) -> list[tuple[Proc, ReadableSpan]]:
        """Every span of one request arriving at the router at ``base_ns``
        (true time), served by ``pair`` in ``mode`` (push | pull), with the
        process that exports each one."""
        rng = self.rng
        tid = rng.getrandbits(128) or 1
        hex_id = f"{tid:032x}"
        root = root_span_id(tid)
        parent = SpanContext(tid, root, True, _SAMPLED)
        p_rid, d_rid = f"cmpl-{hex_id}-0-{rng.getrandbits(32):08x}", f"cmpl-{hex_id}-0-{rng.getrandbits(32):08x}"
        shape = _push(rng) if mode == "push" else _pull(rng)
        ttft_us = next(t1 for role, name, _, t1, _ in shape if name == sc.Phase.DECODE_FIRST_STEP.value) + NET_US
        theta = self.offsets_ns[pair]
        engines = {"prefill": f"p{pair}", "decode": f"d{pair}"}
        peer = {"prefill": f"d{pair}", "decode": f"p{pair}"}
        out = []
        for role, name, t0, t1, extra in shape:
            a = {sc.ATTR_MODE: mode, sc.ATTR_ROLE: role}
            at = base_ns + (theta if role == "decode" else 0)
            if role == "router":
                a[sc.ATTR_REQUEST_ID] = hex_id
                proc = Proc("router", router)
            else:
                a[sc.ATTR_ENGINE_ID] = engines[role]
                a[sc.ATTR_REQUEST_ID] = p_rid if role == "prefill" else d_rid
                proc = Proc(role, pair)
            a[sc.ATTR_OUTCOME] = "ok"
            for k, v in extra.items():
                if k == sc.ATTR_REMOTE_ENGINE_ID:
                    v = peer[role]
                elif k == sc.ATTR_JOIN_REQUEST_ID:
                    v = p_rid
                a[k] = v
            if name == sc.Phase.REQUEST.value:
                a[sc.ATTR_TTFT_S] = ttft_us / 1e6
                ctx, par = SpanContext(tid, root, False, _SAMPLED), None
            else:
                ctx, par = SpanContext(tid, rng.getrandbits(64) or 1, False, _SAMPLED), parent
            span = ReadableSpan(
                name,
                ctx,
                par,
                self.resources[proc],
                a,
                (),
                (),
                _INTERNAL,
                None,
                _UNSET,
                at + t0 * US,
                at + t1 * US,
                _SCOPE,
            )
            out.append((proc, span))
        return out


def _net(rng: random.Random) -> int:
    return NET_US + rng.randrange(-NET_US // 2, NET_US)


def _xfer(rng: random.Random) -> tuple[int, dict]:
    blocks = rng.choice((8, 16, 32, 64))
    us = 400 + blocks * 60 + rng.randrange(500)
    attrs = {sc.ATTR_BYTES: blocks * 131072, sc.ATTR_DESCRIPTORS: blocks * 4, sc.ATTR_NIXL_XFER_S: us / 1e6}
    return us, {**attrs, sc.ATTR_REMOTE_ENGINE_ID: "", sc.ATTR_BLOCKS: blocks}


def _posted(blocks: int, join: bool) -> dict:
    """The attributes of ``descriptor.prep`` and ``*.post`` (worker.py)."""
    a = {sc.ATTR_BLOCKS: blocks, sc.ATTR_REMOTE_ENGINE_ID: "", sc.ATTR_REMOTE_RANK: 0, sc.ATTR_REMOTE_RANKS: (0,)}
    if join:
        a[sc.ATTR_JOIN_REQUEST_ID] = ""
    return a


# (role, span name, start us, end us, attributes beyond mode/role/engine/request id/outcome);
# "" values are filled per request (the peer's engine id, P's request id)
def _push(rng: random.Random) -> list[tuple[str, str, int, int, dict]]:
    """Overlapped push: the router sends the request to P and D at once, D
    registers its blocks with P (D->P crossing), P writes the KV into them
    when its prefill is done, the WRITE's notification reaches D (P->D)."""
    tokens = rng.randrange(256, 4096)
    f = 300 + tokens * 8 + rng.randrange(2000)  # prefill.finished
    reg = 1600 + rng.randrange(400)  # D's registration sent
    got = reg + _net(rng)  # ... and received on P
    xfer, xattrs = _xfer(rng)
    kv = f + 300 + xfer + _net(rng)  # kv.ready on D: the WRITE's notification arrived
    first = kv + 200 + 8000 + rng.randrange(8000)
    end = first + 20000 + rng.randrange(40000)
    blocks = xattrs[sc.ATTR_BLOCKS]
    return [
        ("prefill", "prefill", 300, f, {sc.ATTR_BLOCKS: blocks, sc.ATTR_TOKENS: tokens}),
        ("decode", "decode.queue", 400, 1400, {sc.ATTR_TOKENS: tokens}),
        (
            "decode",
            "registration.stage",
            1400,
            1400,
            {sc.ATTR_REMOTE_ENGINE_ID: "", sc.ATTR_TOKENS: tokens, sc.ATTR_BLOCKS: blocks},
        ),
        ("decode", "registration.send", reg, reg + 80, {sc.ATTR_REMOTE_ENGINE_ID: "", sc.ATTR_BLOCKS: blocks}),
        ("prefill", "registration.receive", got, got, {}),
        ("prefill", "prefill.finished", f, f, {sc.ATTR_BLOCKS: blocks, sc.ATTR_TOKENS: tokens}),
        ("prefill", "match", min(got, f), f + 50, {sc.ATTR_MATCH_FIRST: "registration"}),
        ("prefill", "descriptor.prep", f + 100, f + 200, _posted(blocks, False)),
        ("prefill", "write.post", f + 200, f + 300, _posted(blocks, False)),
        ("prefill", "write.complete", f + 200, f + 200 + xfer, xattrs),
        ("decode", "kv.ready", kv, kv, {}),
        ("decode", "decode.first_step", kv + 200, first, {sc.ATTR_KV_RECOMPUTED_TOKENS: 0, sc.ATTR_BLOCK_SIZE: 16}),
        ("router", "relay", first + NET_US, end, {}),
        ("router", "request", 0, end + 100, {sc.ATTR_DISPATCH: "overlapped"}),
    ]


def _pull(rng: random.Random) -> list[tuple[str, str, int, int, dict]]:
    """Pull: P prefills, its answer goes through the router to D (P->D
    crossing), D reads the KV and P learns it is done when the READ's
    notification arrives (D->P, ``kv.released``)."""
    tokens = rng.randrange(256, 4096)
    f = 300 + tokens * 8 + rng.randrange(2000)
    relay = f + _net(rng)
    alloc = relay + 200 + _net(rng) + 600  # D's request arrived, blocks allocated
    xfer, xattrs = _xfer(rng)
    post = alloc + 150
    kv = post + xfer + 50
    released = post + xfer + _net(rng)  # the READ's notification reached P
    first = kv + 200 + 8000 + rng.randrange(8000)
    end = first + 20000 + rng.randrange(40000)
    blocks = xattrs[sc.ATTR_BLOCKS]
    join = {sc.ATTR_JOIN_REQUEST_ID: ""}
    return [
        ("prefill", "prefill", 300, f, {sc.ATTR_BLOCKS: blocks, sc.ATTR_TOKENS: tokens}),
        ("prefill", "prefill.finished", f, f, {sc.ATTR_BLOCKS: blocks, sc.ATTR_TOKENS: tokens}),
        ("router", "relay", relay, relay + 200, {}),
        ("decode", "decode.queue", alloc - 600, alloc, {sc.ATTR_TOKENS: tokens, **join}),
        (
            "decode",
            "alloc",
            alloc,
            alloc,
            {sc.ATTR_REMOTE_ENGINE_ID: "", sc.ATTR_TOKENS: tokens, sc.ATTR_BLOCKS: blocks, **join},
        ),
        ("decode", "descriptor.prep", alloc + 50, post, _posted(blocks, True)),
        ("decode", "read.post", post, post + 100, _posted(blocks, True)),
        ("decode", "read.complete", post, post + xfer, {**xattrs, **join}),
        ("decode", "kv.ready", kv, kv, {}),
        ("prefill", "kv.released", released, released, {}),
        ("decode", "decode.first_step", kv + 200, first, {sc.ATTR_KV_RECOMPUTED_TOKENS: 0, sc.ATTR_BLOCK_SIZE: 16}),
        ("router", "request", 0, end + 100, {sc.ATTR_DISPATCH: "sequential"}),
    ]


# ------------------------------------------------------------ fast encoder
# ``encode_spans(spans).SerializeToString()`` costs ~45 us a span; a load
# generator that pre-builds minutes of a fleet's traffic needs it ~10x
# cheaper. This writes the same protobuf bytes directly (the unit test pins
# byte equality with the SDK's encoder for these spans): field order,
# omitted defaults and oneof presence as protobuf serialises them.
def _varint(n: int) -> bytes:
    if 0 <= n < _SMALL:
        return _VARINTS[n]
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = 1 << 14
_VARINTS: list[bytes] = []
_VARINTS += [bytes((n,)) if n < 0x80 else bytes(((n & 0x7F) | 0x80, n >> 7)) for n in range(_SMALL)]


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (``tag``: field number << 3 | 2, one byte)."""
    n = len(payload)
    return bytes((tag,)) + (_VARINTS[n] if n < _SMALL else _varint(n)) + payload


def _any(v) -> bytes:
    if isinstance(v, str):
        return _field(0x0A, v.encode())
    if isinstance(v, bool):
        return b"\x10" + (b"\x01" if v else b"\x00")
    if isinstance(v, int):
        return b"\x18" + _varint(v)
    if isinstance(v, float):
        return b"\x21" + struct.pack("<d", v)
    if isinstance(v, (tuple, list)):
        return _field(0x2A, b"".join(_field(0x0A, _any(x)) for x in v))
    raise TypeError(f"attribute value {v!r} of type {type(v).__name__} is not encoded here")


_KV_CACHE: dict = {}


def _kv_body(key: str, value) -> bytes:
    return _field(0x0A, key.encode()) + _field(0x12, _any(value))


def _kv(key: str, value) -> bytes:
    """One span attribute (``KeyValue``, field 9); the values that repeat
    (engines, modes, block counts) are cached, unique ones (request ids) not."""
    ck = None if isinstance(value, (list, tuple)) else (key, type(value), value)
    hit = _KV_CACHE.get(ck) if ck else None
    if hit is None:
        hit = _field(0x4A, _kv_body(key, value))
        if ck and key not in _UNIQUE_KEYS and len(_KV_CACHE) < 100_000:
            _KV_CACHE[ck] = hit
    return hit


_UNIQUE_KEYS = frozenset((sc.ATTR_REQUEST_ID, sc.ATTR_JOIN_REQUEST_ID, sc.ATTR_TTFT_S, sc.ATTR_NIXL_XFER_S))
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)  # ... and IS_REMOTE: the parent came from elsewhere


def _span_bytes(s: ReadableSpan) -> bytes:
    ctx, parent = s.context, s.parent
    out = [b"\x0a\x10", ctx.trace_id.to_bytes(16, "big"), b"\x12\x08", ctx.span_id.to_bytes(8, "big")]
    if parent is not None:
        out += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    out += (_field(0x2A, s.name.encode()), b"\x30\x01\x39", struct.pack("<Q", s.start_time))
    out += (b"\x41", struct.pack("<Q", s.end_time))
    out += [_kv(k, v) for k, v in s.attributes.items()]
    out += (b"\x7a\x00", _FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL)
    return b"".join(out)


_HEADS: dict = {}


def _head(resource: Resource, scope: InstrumentationScope) -> tuple[bytes, bytes]:
    """The encoded ``Resource`` field of a ``ResourceSpans`` and the
    ``scope`` field of a ``ScopeSpans``, once per process (the cache holds
    the objects too, so their ids are not reused by others while cached)."""
    key = (id(resource), id(scope))
    got = _HEADS.get(key)
    if got is None or got[2] is not resource or got[3] is not scope:
        res = b"".join(_field(0x0A, _kv_body(k, v)) for k, v in resource.attributes.items())
        sc_body = _field(0x0A, scope.name.encode()) + (_field(0x12, scope.version.encode()) if scope.version else b"")
        got = _HEADS[key] = (_field(0x0A, res), _field(0x0A, sc_body), resource, scope)
    return got[0], got[1]


def encode(spans) -> bytes:
    """An OTLP/protobuf ``ExportTraceServiceRequest`` of ``spans`` (grouped
    by resource, then scope, in order of first appearance, as the SDK's
    ``encode_spans`` does), byte for byte what that encoder writes for the
    spans :class:`Fleet` builds (no events, links, trace state or status)."""
    groups: dict = {}  # by identity: hashing a scope JSON-encodes its attributes every time
    for s in spans:
        res, scope = s.resource, s.instrumentation_scope
        groups.setdefault(id(res), (res, {}))[1].setdefault(id(scope), (scope, []))[1].append(_span_bytes(s))
    out = []
    for resource, scopes in groups.values():
        parts = []
        for scope, encoded in scopes.values():
            res_field, scope_field = _head(resource, scope)
            parts.append(_field(0x12, scope_field + b"".join(_field(0x12, b) for b in encoded)))
        out.append(_field(0x0A, res_field + b"".join(parts)))
    return b"".join(out)
