"""Trace-store read benchmark for the dashboard and ``kvlens traces``.

Writes N traces (default 100 000, ~10 spans each: ~1 M spans) straight into
a store created by ``exporters.store.connect`` (same schema, rows inserted
as they are with ``store.bulk_insert``: the OTel pipeline would take
minutes), then times the reads the dashboard makes and prints medians and
the query plans (``store.slowest_plan``).

    python benchmarks/bench_store.py [--traces 100000] [--store PATH] [--repeat 15]

Goal: slowest 50 with filters <= 200 ms.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dashboard import data as D
from exporters import store
from instrumented_connector import semconv as sc

MS = 1_000_000
GOAL_MS = 200.0


def _span(tid, i, parent, name, role, mode, rid, t0, t1, outcome, attrs):
    return (tid, f"{i:016x}", parent, name, role, mode, rid, t0, t1, outcome,
            json.dumps(attrs, separators=(",", ":")))


def populate(path: Path, n: int, seed: int = 1, span_h: float = 24.0) -> tuple[int, int]:
    """Write ``n`` traces spread over the last ``span_h`` hours. Returns (traces, spans)."""
    rng = random.Random(seed)
    conn = store.connect(path, durable=False)
    now = time.time_ns()
    base = now - int(span_h * 3600e9)
    step = int(span_h * 3600e9 / n)
    spans, traces, n_spans = [], [], 0
    sid = 1
    P = sc.Phase

    def flush():
        nonlocal spans, traces
        store.bulk_insert(conn, spans, traces)  # one transaction per batch
        spans, traces = [], []

    for k in range(n):
        mode = "push" if k % 2 == 0 else "pull"
        tid = secrets.token_hex(16)
        rid = f"cmpl-{tid}-0-{rng.getrandbits(32):08x}"
        t0 = base + k * step
        root = f"{sid:016x}"
        pf = t0 + int(rng.uniform(20, 80) * MS)
        fail = rng.random() < 0.02
        outcome = ("failed" if mode == "pull" else "timeout") if fail else "ok"
        blocks = rng.choice([4, 8, 16, 32])
        a = {sc.ATTR_MODE: mode, sc.ATTR_BLOCKS: blocks, sc.ATTR_BYTES: blocks * 131072,
             sc.ATTR_DESCRIPTORS: blocks * 4, sc.ATTR_ENGINE_ID: "p0", sc.ATTR_REQUEST_ID: rid}
        ph: list[tuple] = [(P.PREFILL, "prefill", t0 + MS, pf), (P.PREFILL_FINISHED, "prefill", pf, pf)]
        t = pf
        if mode == "push":
            ph += [(P.REGISTRATION_STAGE, "decode", t0 + 2 * MS, t0 + 2 * MS),
                   (P.REGISTRATION_SEND, "decode", t0 + 2 * MS, t0 + 3 * MS),
                   (P.REGISTRATION_RECEIVE, "prefill", t0 + 4 * MS, t0 + 4 * MS),
                   (P.MATCH, "prefill", t0 + 4 * MS, pf)]
            for name in (P.DESCRIPTOR_PREP, P.WRITE_POST, P.WRITE_COMPLETE):
                d = int(rng.uniform(0.2, 6) * MS)
                ph.append((name, "prefill", t, t + d))
                t += d
        else:
            d = int(rng.uniform(1, 3) * MS)
            ph.append((P.RELAY, "router", t, t + d))
            t += d
            ph.append((P.ALLOC, "decode", t, t))
            for name in (P.DESCRIPTOR_PREP, P.READ_POST, P.READ_COMPLETE):
                d = int(rng.uniform(0.2, 8) * MS)
                ph.append((name, "decode", t, t + d))
                t += d
        kv = None
        if not fail:
            kv = t + int(rng.uniform(0.2, 1) * MS)
            ph.append((P.KV_READY, "decode", kv, kv))
        ttft = (kv - t0) / 1e9 + 0.01 if kv else None
        end = (kv or t) + 40 * MS
        spans.append(_span(tid, sid, None, P.REQUEST.value, "router", mode, tid, t0, end, outcome,
                           {sc.ATTR_MODE: mode, sc.ATTR_TTFT_S: ttft, sc.ATTR_DISPATCH: "overlapped"}))
        sid += 1
        for name, role, s0, s1 in ph:
            spans.append(_span(tid, sid, root, name.value, role, mode, rid, s0, s1,
                               outcome if name in (P.WRITE_COMPLETE, P.READ_COMPLETE) else "ok", a))
            sid += 1
        n_spans += 1 + len(ph)
        traces.append((tid, tid, mode, "overlapped" if mode == "push" else "sequential", outcome, t0, end, ttft,
                       pf, kv, 1 + len(ph), (kv - pf) / 1e9 if kv else None, 0.001 if kv else None))
        if len(spans) >= 50_000:
            flush()
    flush()
    store.checkpoint(conn)
    conn.close()
    return n, n_spans


def timeit(fn, repeat: int) -> tuple[float, object]:
    out, ts = None, []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=int, default=100_000)
    ap.add_argument("--store", type=Path, default=None, help="store file (default: a temp file, removed after)")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)

    tmp = None
    if args.store is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvlens-bench-")
        path = Path(tmp.name) / "traces.db"
    else:
        path = args.store
        if path.exists():
            sys.exit(f"{path} exists; pass a new file")
    try:
        t = time.perf_counter()
        n_tr, n_sp = populate(path, args.traces)
        wr = time.perf_counter() - t
        print(f"wrote {n_tr:,} traces / {n_sp:,} spans in {wr:.1f} s ({n_sp / wr:,.0f} spans/s); "
              f"file {path.stat().st_size / 1e6:.0f} MB")

        conn = store.connect(path, readonly=True)
        now = time.time_ns()
        h1 = now - 3600 * 10**9
        push = store.slowest(conn, 1, mode="push")[0]
        p99 = push["handoff_s"]
        cases = {
            "slowest 50 (no filter)": dict(),
            "slowest 50 mode=push": dict(mode="push"),
            "slowest 50 mode=pull outcome=ok": dict(mode="pull", outcome="ok"),
            "slowest 50 mode=pull outcome=failed": dict(mode="pull", outcome="failed"),
            "slowest 50 mode=push since 1h": dict(mode="push", since_ns=h1),
            "slowest 50 since 1h (any mode)": dict(since_ns=h1),
            "slowest 50 mode=push 5ms<=handoff<6ms": dict(mode="push", min_handoff_s=0.005, max_handoff_s=0.006),
            "slowest 50 mode=push handoff>=top": dict(mode="push", min_handoff_s=p99 * 0.9),
            "slowest 50 order=ttft": dict(order="ttft"),
        }
        rows = []
        for name, kw in cases.items():
            ms, res = timeit(lambda kw=kw: store.slowest(conn, 50, **kw), args.repeat)
            rows.append((name, ms, len(res)))
        tid = push["trace_id"]
        ms, res = timeit(lambda: store.spans_for(conn, [tid]), args.repeat)
        rows.append(("spans_for(one trace)", ms, len(res[tid])))
        ms, res = timeit(lambda: D.trace_detail(path, tid), args.repeat)
        rows.append(("dashboard trace_detail (waterfall)", ms, len(res[1])))
        ms, res = timeit(lambda: D.window_traces(path, h1, now), max(3, args.repeat // 3))
        rows.append(("dashboard window_traces 1h", ms, len(res)))
        ms, res = timeit(lambda: D.window_traces(path, None, None), 3)
        rows.append(("dashboard window_traces all (limit 200k)", ms, len(res)))
        ms, res = timeit(lambda: D.phase_breakdown(path, h1, now), max(3, args.repeat // 3))
        rows.append(("dashboard phase_breakdown 1h (5k sample)", ms, len(res)))
        ms, res = timeit(lambda: D.store_info(path), max(3, args.repeat // 3))
        rows.append(("dashboard store_info", ms, res["traces"]))

        print(f"\n{'read':48s} {'median ms':>10s} {'rows':>8s}")
        worst = 0.0
        for name, ms, n in rows:
            flag = ""
            if name.startswith("slowest"):
                worst = max(worst, ms)
                flag = "  <-- over goal" if ms > GOAL_MS else ""
            print(f"{name:48s} {ms:10.1f} {n:8d}{flag}")
        print(f"\nworst 'slowest 50' median: {worst:.1f} ms (goal <= {GOAL_MS:.0f} ms): "
              f"{'OK' if worst <= GOAL_MS else 'OVER'}")

        print("\nquery plans:")
        for name, kw in cases.items():
            print(f"  {name:44s} {store.slowest_plan(conn, 50, **kw)}")
        conn.close()
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
