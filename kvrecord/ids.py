"""Request and trace ids: the one module that chooses, parses and derives them.

How one request gets one trace across router, P and D without any change to
vLLM (docs/phases.md, "Trace correlation"):

* the router picks a 32-hex W3C trace id (:func:`incoming_trace`): a valid
  client ``traceparent`` wins, then a client ``X-Request-Id`` that already is
  32 lowercase hex, else a fresh one (:func:`new_trace_id`);
* it sends that id to P and D as ``X-Request-Id``; vLLM turns it into
  ``cmpl-<id>-0-<8 hex>`` (``chatcmpl-<id>-<8 hex>``) on each side;
* every kvlens process reads the trace id back out of its vLLM request id
  (:func:`trace_id_for`) and parents its spans to the router's root span,
  whose span id is derived from the trace id (:func:`root_span_id`).

:class:`PinnedIdGenerator` is the OTel ``IdGenerator`` that lets the recorder
give the root span those derived ids.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import secrets
import threading
from typing import Iterator, Mapping

from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import format_trace_id

from kvrecord.semconv import ATTR_JOIN_REQUEST_ID

_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)  # as vLLM's get_base_request_id
_HEX32_RE = re.compile(r"[0-9a-f]{32}")
_HEX32_FULL = re.compile(r"^[0-9a-f]{32}$")
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


# ------------------------------------------------------------ choosing (router)
def new_trace_id() -> str:
    """A fresh W3C-valid trace id: 32 lowercase hex, not all zero."""
    while True:
        tid = secrets.token_hex(16)
        if int(tid, 16):
            return tid


def parse_traceparent(value: str | None) -> tuple[str, int] | None:
    """(trace id hex, parent span id) of a valid W3C ``traceparent``, else None."""
    m = _TRACEPARENT.match((value or "").strip().lower())
    if m and m.group(1) != "ff" and int(m.group(2), 16) and int(m.group(3), 16):
        return m.group(2), int(m.group(3), 16)
    return None


def incoming_trace(headers: Mapping[str, str]) -> tuple[str, int | None]:
    """(32-hex trace id, parent span id or None) for a request reaching the router."""
    tp = parse_traceparent(headers.get("traceparent"))
    if tp is not None:
        return tp
    rid = (headers.get("x-request-id") or "").strip()
    if _HEX32_FULL.match(rid) and int(rid, 16):
        return rid, None
    return new_trace_id(), None


def vllm_request_id_base(endpoint: str, trace_id: str) -> str:
    """The id vLLM gives a request sent with ``X-Request-Id: trace_id``, without
    its random suffix (what push matching on P compares)."""
    if endpoint.endswith("chat/completions"):
        return f"chatcmpl-{trace_id}"
    return f"cmpl-{trace_id}-0"


# ----------------------------------------------------------- parsing (P, D)
def base_request_id(request_id: str) -> str:
    """Strip vLLM's per-request ``-<8 hex>`` suffix (``get_base_request_id``)."""
    return _SUFFIX_RE.sub("", request_id)


def trace_id_for(request_id: str) -> int:
    """The 128-bit trace id shared by router, P and D for one request.

    A request id holding a 32-hex id (what the router sends) yields that id;
    any other id (a third-party router's uuid) is hashed after stripping the
    random suffix, which P and D do not share."""
    base = base_request_id(request_id)
    m = _HEX32_RE.search(base.lower())
    if m:
        tid = int(m.group(0), 16)
        if tid:
            return tid
    return int.from_bytes(hashlib.blake2b(base.encode(), digest_size=16).digest(), "big") or 1


#: Most D request ids whose P request id one span builder remembers (one
#: dict entry each, ~200 bytes): far more than one engine holds in flight.
MAX_JOINS = 65536


class Joins:
    """Which request id a span's trace comes from (docs/phases.md, "Trace
    correlation"): P's request id where an event of D's request named it
    (``kvlens.join.request_id``: the ``remote_request_id`` of the
    ``kv_transfer_params`` D received), else the span's own request id.

    A router that sends P and D the same ``X-Request-Id`` (kvlens', vLLM's
    ``vllm-router``) gives both the same answer; one that forwards only
    P's ``kv_transfer_params`` (D's own id is then a fresh uuid) still joins
    D to P. The first event that names P's id teaches the request's later
    events in this process (``kv.ready`` only knows D's id). Bounded
    (:data:`MAX_JOINS`, oldest out first). One thread (the span builder)."""

    __slots__ = ("_m", "cap")

    def __init__(self, cap: int = MAX_JOINS) -> None:
        self._m: dict[str, str] = {}
        self.cap = cap

    def key(self, request_id: str, attrs: dict) -> str:
        """The id to derive the trace from; sets ``attrs``' join attribute
        on a span whose earlier event named P's id."""
        m = self._m
        key = attrs.get(ATTR_JOIN_REQUEST_ID)
        if key:
            if request_id not in m:
                if len(m) >= self.cap:
                    del m[next(iter(m))]
                m[request_id] = key
            return key
        key = m.get(request_id)
        if key is None:
            return request_id
        attrs[ATTR_JOIN_REQUEST_ID] = key
        return key


def trace_of_response(response_id: str | None, sent_id: str) -> str:
    """The trace (32 hex) a client finds its request's spans under: the id
    it sent as ``X-Request-Id`` where the router kept it (the response's
    ``id``, ``cmpl-<X-Request-Id>``, holds it: kvlens' router), else the
    trace of the response's own id (a router that put its own id on P and
    D, e.g. ``vllm-router``'s ``___prefill_addr_..._<uuid>``)."""
    if not response_id or sent_id in response_id:
        return sent_id
    return format_trace_id(trace_id_for(response_id))


def root_span_id(trace_id: int) -> int:
    """Span id of the request's root span (the router's ``request`` span),
    derived from the trace id so P and D can parent to it without talking to
    the router."""
    d = hashlib.blake2b(trace_id.to_bytes(16, "big"), digest_size=8, person=b"kvlens-root").digest()
    return int.from_bytes(d, "big") or 1


# ------------------------------------------------------------ OTel generator
class _Pinned(threading.local):
    trace_id: int | None = None
    span_id: int | None = None


class PinnedIdGenerator(RandomIdGenerator):
    """Random ids, except inside :meth:`pin`, where the calling thread's next
    span gets the pinned ids (the root span's derived ids).

    The random ids come from the OS (:func:`secrets.randbits`), not from
    the global ``random`` module the SDK's generator uses: vLLM seeds that
    module (``random.seed(seed)``) in every engine process, so P's and D's
    processes drew the same span-id sequence and two spans of one trace
    could share an id (the store then kept only one of them). The OS source
    is also safe across fork."""

    def __init__(self) -> None:
        self._pinned = _Pinned()

    @staticmethod
    def _bits(n: int) -> int:
        while True:
            v = secrets.randbits(n)
            if v:  # 0 is the invalid id in W3C trace context
                return v

    @contextlib.contextmanager
    def pin(self, *, span_id: int, trace_id: int | None = None) -> Iterator[None]:
        p = self._pinned
        p.span_id, p.trace_id = span_id, trace_id
        try:
            yield
        finally:
            p.span_id = p.trace_id = None

    def generate_span_id(self) -> int:
        sid = self._pinned.span_id
        return sid if sid is not None else self._bits(64)

    def generate_trace_id(self) -> int:
        tid = self._pinned.trace_id
        return tid if tid is not None else self._bits(128)
