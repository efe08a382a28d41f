"""The derived phases three ways agree: read back from the store, from the
span rows held under --keep sampled (``tracemodel.derived_of``), and from
span objects (``tracemodel.derived_spans``, the whole trace model's), all
equal to :func:`reference`: the plain scan per phase and end the grouped
derivation replaced. Random traces: push and pull ends, TP ranks (several
completion spans, NIXL's time missing, zero or not a number), missing
spans, failed and expired outcomes, a router's ``relay`` or not, spans of
the wrong role, equal timestamps across phases, D's clock offset."""

from __future__ import annotations

import json
import random
from typing import Any, NamedTuple

from kvtrace import store, tracemodel
from kvtrace.tiling import DERIVED_NAMES, DERIVATION_INPUTS, Derived
from kvrecord import derived
from kvrecord import semconv as sc

MS = 1_000_000


class _Span(NamedTuple):
    name: str
    role: str | None
    start_ns: int
    end_ns: int
    outcome: str | None
    attributes: Any


def reference(spans: list[Any]) -> list[Derived]:
    """The derivation as first written: every phase scans the trace for each of its ends."""

    def times(role: str, phase: str, end: str) -> list[int]:
        return [s.end_ns if end == "end" else s.start_ns for s in rec if s.role == role and s.name == phase]

    out: list[Derived] = []
    rec = [s for s in spans if s.name not in DERIVED_NAMES]
    present = {s.name for s in rec}
    for phase, how in derived.DERIVED_PHASES.items():
        if how.unless is not None and how.unless.value in present:
            continue
        if how.split is not None:
            for s in rec:
                if s.role != how.role or s.name != how.split.phase.value or s.end_ns <= s.start_ns:
                    continue
                x = (s.attributes or {}).get(how.split.attr)
                if not isinstance(x, (int, float)) or isinstance(x, bool) or x <= 0:
                    continue
                cut = min(s.start_ns + round(float(x) * 1e9), s.end_ns)
                a, b = (s.start_ns, cut) if how.split.head else (cut, s.end_ns)
                if b > a:
                    r = (s.attributes or {}).get(sc.ATTR_RANK)
                    out.append(Derived(phase.value, how.role, a, b, r if isinstance(r, int) else None))
        elif how.latest:
            froms, tos = [], []
            for a, b in how.pairs:
                f = times(a.role, a.phase.value, a.end)
                t = [
                    (s.end_ns if b.end == "end" else s.start_ns, s)
                    for s in rec
                    if (s.role, s.name) == (b.role, b.phase.value)
                ]
                if f and t:
                    froms, tos = froms + f, tos + t
            if froms and max(tos, key=lambda x: x[0])[0] > max(froms):
                t1, last = max(tos, key=lambda x: x[0])
                out.append(Derived(phase.value, how.role, max(froms), t1, None, last.outcome))
        else:
            for a, b in how.pairs:
                froms, tos = times(a.role, a.phase.value, a.end), times(b.role, b.phase.value, b.end)
                if froms and tos:
                    after = [t for t in tos if t >= max(froms)]
                    if after and min(after) > max(froms):
                        out.append(Derived(phase.value, how.role, max(froms), min(after)))
                    break
    return out


#: (role, phase) of every end and split a derivation reads, a span of a role none reads, and others.
_KINDS = sorted(
    {(e.role, e.phase.value) for how in derived.DERIVED_PHASES.values() for pair in how.pairs for e in pair}
    | {(how.role, how.split.phase.value) for how in derived.DERIVED_PHASES.values() if how.split}
    | {("router", "relay"), ("prefill", "relay"), ("decode", "prefill.finished"), ("prefill", "write.post")}
    | {("prefill", "kv.hold"), ("router", "request"), ("decode", "llm_request")}
)


def _attributes(rng: random.Random, name: str) -> dict:
    a: dict[str, Any] = {sc.ATTR_OUTCOME: "ok", "service.name": "x"}
    if rng.random() < 0.8:
        a[sc.ATTR_NIXL_XFER_S] = rng.choice([0.0004, 0.0011, 0.05, 0.0, -1.0, True, "0.001", 3])
    if rng.random() < 0.6:
        a[sc.ATTR_RANK] = rng.choice([0, 1, 3, True, "2"])
    return a


def _trace(rng: random.Random, tid: str) -> list[tuple]:
    """One trace's span rows (``store.SPAN_COLUMNS``), the attributes a dict."""
    rows, seen = [], set()
    base = 1_700_000_000 * 10**9 + rng.randrange(10**12)
    for role, name in _KINDS:
        if rng.random() < 0.25:
            continue  # missing
        for _ in range(rng.choice([1, 1, 1, 2, 3])):  # TP ranks, a phase recorded twice
            start = base + rng.randrange(40) * MS // 10  # a coarse grid: equal timestamps across phases
            end = start + rng.choice([0, rng.randrange(30) * MS // 10])
            if (role, name, start, end) in seen:
                continue  # one order of equal spans in one phase: neither read promises one
            seen.add((role, name, start, end))
            outcome = rng.choice(["ok", "ok", "failed", "expired", None])
            sid = "%016x" % rng.getrandbits(64)
            rows.append((tid, sid, None, name, role, "push", "r", start, end, outcome, _attributes(rng, name)))
    rng.shuffle(rows)
    return rows


def test_derived_phases_agree_from_store_held_rows_and_span_objects(backend):
    rng = random.Random(20261204)
    offsets, held = {}, {}
    for i in range(300):
        tid = "%032x" % rng.getrandbits(128)
        offsets[tid] = rng.choice([None, 0.0, 0.0123456, -0.0042, 2.5e-7])
        held[tid] = _trace(rng, tid)
    stored = [(*r[:-1], json.dumps(r[-1])) for rows in held.values() for r in rows]
    conn = store.connect(backend.store)
    try:
        store.bulk_insert(conn, stored, [])
        from_store = tracemodel.derived_of(conn, offsets)
        # held rows as the Keeper holds them (attributes a dict), and some already encoded
        held_rows = {
            t: rows if i % 3 else [(*r[:-1], json.dumps(r[-1])) for r in rows]
            for i, (t, rows) in enumerate(held.items())
        }
        from_held = tracemodel.derived_of(conn, offsets, held_rows)
        half = dict(list(held.items())[::2])  # half of them held, the rest read from the store
        mixed = tracemodel.derived_of(conn, offsets, half)
    finally:
        conn.close()
    derived_count = 0
    for tid, rows in held.items():
        shift = tracemodel.d_shift_ns(offsets[tid])
        spans = [
            _Span(
                r[3],
                r[4],
                r[7] - (shift if r[4] == "decode" else 0),
                r[8] - (shift if r[4] == "decode" else 0),
                r[9],
                r[10],
            )
            for r in sorted(rows, key=lambda r: (r[7], r[8]))
        ]
        want = reference(spans)
        derived_count += len(want)
        assert tracemodel.derived_spans(spans) == want
        assert tracemodel.derived_spans([s for s in spans if s.name in DERIVATION_INPUTS]) == want
        assert from_store[tid] == want and from_held[tid] == want and mixed[tid] == want
    assert derived_count > 500  # not nothing: the phases below, from every kind of end
    names = {d.name for ds in from_held.values() for d in ds}
    assert names == {p.value for p in derived.DERIVED_PHASES}
    holds = [d for ds in from_held.values() for d in ds if d.name == "kv.hold"]
    assert {d.outcome for d in holds} >= {"ok", "failed", "expired"}
    assert {d.rank for ds in from_held.values() for d in ds} >= {None, 0, 1, 3}
