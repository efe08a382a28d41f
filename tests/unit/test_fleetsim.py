"""The fleet simulation's spans are kvlens-shaped: what
``benchmarks/kvspans.py`` builds goes through the collector's decoder and
the store's writer like the router's, P's and D's own spans, and the clock
offset injected between a pair's P and D is recovered inside the bounds the
store settles (``benchmarks/bench_fleetsim.py`` measures the same at scale
against a real ``kvlens collect``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from collector import otlp
from kvrecord import semconv as sc
from kvrecord.ids import root_span_id
from kvtrace import store
from kvtrace.store import queries

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from kvspans import Fleet, encode  # noqa: E402

PAIRS = 3


def _by_process(fleet: Fleet, n: int) -> dict:
    """``n`` requests (push and pull alternating) over the pairs, spans grouped
    by the process that exports them (P's and D's in separate bodies)."""
    t0 = time.time_ns() - 10**10
    out: dict = {}
    for i in range(n):
        for proc, span in fleet.request(
            t0 + i * 5_000_000, i % fleet.pairs, "push" if i % 2 else "pull", i % fleet.routers
        ):
            out.setdefault(proc, []).append(span)
    return out


def test_fast_encoder_writes_the_sdk_encoders_bytes():
    for spans in _by_process(Fleet(PAIRS, 2, seed=3), 8).values():
        assert encode(spans) == encode_spans(spans).SerializeToString()


def test_decoded_spans_have_the_shape_the_store_reads():
    spans = [s for body in _by_process(Fleet(1, seed=4), 2).values() for s in otlp.decode(encode(body), otlp.PROTOBUF)]
    by_trace: dict = {}
    for s in spans:
        by_trace.setdefault(s.context.trace_id, []).append(s)
    assert len(by_trace) == 2
    for tid, group in by_trace.items():
        root = [s for s in group if s.name == sc.Phase.REQUEST.value]
        assert len(root) == 1 and root[0].parent is None and root[0].context.span_id == root_span_id(tid)
        assert all(s.parent.span_id == root_span_id(tid) for s in group if s is not root[0])
        mode = root[0].attributes[sc.ATTR_MODE]
        names = {(s.attributes[sc.ATTR_ROLE], s.name) for s in group}
        # both clock crossings of the mode (semconv.CROSSINGS) are there
        crossings = {(r, n) for (r, n, m) in sc.CROSSINGS if m in (None, mode)}
        need = {("decode", "registration.send"), ("prefill", "write.post")} if mode == "push" else set()
        need |= {("decode", "read.post"), ("prefill", "kv.released"), ("decode", "alloc")} if mode == "pull" else set()
        assert need <= names and need <= crossings
        assert {s.attributes["service.name"] for s in group} == {"kvlens-router", "kvlens-prefill", "kvlens-decode"}


def test_injected_offsets_lie_in_the_settled_bounds(backend):
    fleet = Fleet(PAIRS, 2, spread_ms=50.0, seed=5)
    conn = store.connect(backend.store)
    try:
        for spans in _by_process(fleet, 24).values():  # one export per process, as real ones send them
            store.write_spans(conn, otlp.decode(encode(spans), otlp.PROTOBUF))
    finally:
        conn.close()
    with store.reading(backend.store) as c:
        got = queries.pair_clocks(c)
    assert set(got) == {(f"p{k}", f"d{k}") for k in range(PAIRS)}
    for k, theta_ns in enumerate(fleet.offsets_ns):
        g = got[f"p{k}", f"d{k}"]
        assert g["settled"] == g["n"] == 8
        assert g["lo_s"] <= theta_ns / 1e9 <= g["hi_s"], (k, theta_ns, g)
        assert g["hi_s"] - g["lo_s"] < 0.005  # bounded to a few ms, not just "somewhere in +-50 ms"
