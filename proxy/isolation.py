"""One trace id per request, whatever ids clients send (:class:`TraceIds`).

Why: the trace id is also what P and D see. The router sends it as
``X-Request-Id``; vLLM makes it ``cmpl-<id>-0-<8 hex>`` on each side, and an
overlapped push tells D P's *base* id (``cmpl-<id>-0``), which P's push
matcher compares without the random suffix. Two requests carrying one id
would therefore share a vLLM base request id: P could hand one request's KV
to the other's decode, and their traces would merge (the second root span
overwrites the first). A client must not be able to cause that, by accident
(a retry library reusing its id, parallel calls inside one W3C trace) or on
purpose.

The rule: a client's id (a 32-hex ``X-Request-Id`` or a ``traceparent``'s
trace id, :func:`kvrecord.ids.incoming_trace`) is used as the
trace id only when this router has no request with that id in flight,
did not end one within ``reuse_window_s`` (P may still hold that request's
KV: a push waiting for its registration, a lease not yet expired), and never
used it before (its trace exists: "After the window" below). Otherwise
the request gets a fresh id; the client's ids are kept as root-span
attributes and the answer's ``X-Request-Id`` names the id used. Clients that
send a new id per request (the bench, the e2e tests, any sane client) keep
their id, so their traces stay joinable by it.

Why not always a fresh id: clients (``kvlens bench``, tests, users' own
tracing) look their requests up by the id they sent, and a client's
``traceparent`` is only useful when its trace id is kept.

After the window (issue 42). P's KV is safe once the window is over, but the
*trace* is not: the store keys spans by trace id, so a request that took an
id reused after the window would write its spans into the old request's
trace (two roots, two handoffs, one trace). So an id is also remembered for
good, in a fixed-size Bloom filter (:class:`UsedIds`, :data:`USED_BITS`
bits = 4 MiB, whatever the request rate): an id this router used once is
never used as a trace id again, and a client that sends it again gets a
fresh one, its own kept as an attribute, as inside the window. Why a filter
and not a longer window or a bigger exact set: an exact set costs ~100
bytes an id, so at fleet rates it either grows without bound or forgets
(the window's set forgets after :data:`MAX_REMEMBERED` ids, minutes at a
few hundred requests per second); the filter never forgets and never
grows. Its only error is the safe one: a false positive gives a client a
fresh id although it had not used its own before (about 0.2 % of new ids
after 2 million requests, rising as it fills; a router restarted starts
empty). Not covered: ids used before this process started, or by another
router (see Scope).

Scope: one router process (the ids are in its memory); two routers in front
of one P/D pair must not share clients' ids. Event loop only (no locks).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Mapping

from kvrecord import semconv as sc
from kvrecord.ids import incoming_trace, new_trace_id, parse_traceparent

#: Root-span attributes holding what the client sent when it differs from
#: the trace id used (the vocabulary's names, re-exported).
ATTR_CLIENT_REQUEST_ID = sc.ATTR_CLIENT_REQUEST_ID
ATTR_CLIENT_TRACE_ID = sc.ATTR_CLIENT_TRACE_ID

#: Most ended ids remembered; beyond it the oldest are forgotten first (the
#: in-flight set is never trimmed). ~100 bytes each.
MAX_REMEMBERED = 65536
#: Longest client id kept as an attribute (characters).
MAX_ATTR_CHARS = 128
#: Size of the filter of every id ever used (:class:`UsedIds`): 2**25 bits, 4 MiB.
USED_BITS = 1 << 25
#: Bits set per id in that filter.
USED_HASHES = 4


class UsedIds:
    """A Bloom filter of ids (module docstring): :meth:`add`, and ``in``
    (never a false negative; a false positive now and then). ``bits`` 0:
    remembers nothing. Fixed memory: ``bits`` / 8 bytes."""

    def __init__(self, bits: int = USED_BITS, hashes: int = USED_HASHES) -> None:
        self.bits, self.hashes = bits, hashes
        self._field = bytearray(bits // 8)

    def _positions(self, tid: str) -> list[int]:
        d = hashlib.blake2b(tid.encode(), digest_size=4 * self.hashes).digest()
        return [int.from_bytes(d[4 * i : 4 * i + 4], "little") % self.bits for i in range(self.hashes)]

    def add(self, tid: str) -> None:
        if self.bits:
            for b in self._positions(tid):
                self._field[b >> 3] |= 1 << (b & 7)

    def __contains__(self, tid: str) -> bool:
        return bool(self.bits) and all(self._field[b >> 3] >> (b & 7) & 1 for b in self._positions(tid))


class TraceIds:
    """The trace ids a router uses: in flight (exact) and recently ended."""

    def __init__(self, reuse_window_s: float, max_remembered: int = MAX_REMEMBERED, used_bits: int = USED_BITS) -> None:
        self.window_s = reuse_window_s
        self.max_remembered = max_remembered
        self.in_flight: set[str] = set()
        self._ended: OrderedDict[str, float] = OrderedDict()  # id -> monotonic end, oldest first
        self.used = UsedIds(used_bits)  # every id given out, for good (after the window: the trace)

    def taken(self, tid: str) -> bool:
        self._forget_old()
        return tid in self.in_flight or tid in self._ended or tid in self.used

    def claim(self, headers: Mapping[str, str]) -> tuple[str, int | None, dict[str, str]]:
        """(trace id, parent span id or None, client-id attributes) for a new
        request; the id is in flight until :meth:`release`."""
        tid, parent = incoming_trace(headers)
        if self.taken(tid):
            tid, parent = self._fresh(), None
        self.in_flight.add(tid)
        self.used.add(tid)
        return tid, parent, client_attrs(headers, tid)

    def release(self, tid: str) -> None:
        """The request ``tid`` ended: remembered for the reuse window."""
        self.in_flight.discard(tid)
        if self.window_s <= 0:
            return
        self._ended[tid] = time.monotonic()
        self._ended.move_to_end(tid)
        while len(self._ended) > self.max_remembered:
            self._ended.popitem(last=False)

    def _fresh(self) -> str:
        while True:
            tid = new_trace_id()
            if not self.taken(tid):
                return tid

    def _forget_old(self) -> None:
        horizon = time.monotonic() - self.window_s
        ended = self._ended
        while ended:
            tid, t = next(iter(ended.items()))
            if t > horizon:
                break
            del ended[tid]


def client_attrs(headers: Mapping[str, str], tid: str) -> dict[str, str]:
    """The client's ``X-Request-Id`` and ``traceparent`` trace id, for those
    that are present and differ from ``tid`` (clipped to
    :data:`MAX_ATTR_CHARS`)."""
    attrs = {}
    rid = (headers.get("x-request-id") or "").strip()
    if rid and rid != tid:
        attrs[ATTR_CLIENT_REQUEST_ID] = rid[:MAX_ATTR_CHARS]
    tp = parse_traceparent(headers.get("traceparent"))
    if tp is not None and tp[0] != tid:
        attrs[ATTR_CLIENT_TRACE_ID] = tp[0]
    return attrs
