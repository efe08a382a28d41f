"""Trace-store benchmark, SQLite vs PostgreSQL side by side: ingest, the
dashboard's reads at size, store size, retention.

Per backend (``--backend sqlite|postgresql|both``):

1. **ingest**: spans/s through the writer the collector uses
   (``store.write_spans``: folding, upserts, the settle pass), batches of
   2000 spans, with one writer process and with four writing at once
   (several collectors / vLLM processes on one store).
2. **populate** N traces (default 1 000 000, ~11 spans each) over 48 h with
   ``store.bulk_insert`` (SQLite: executemany; PostgreSQL: COPY), then time
   the reads the dashboard and ``kvlens traces`` make (medians) and print
   the query plans (``store.slowest_plan``). Goal: ``slowest 50`` and one
   trace's waterfall under 200 ms.
3. **size**: the store's bytes per million traces (SQLite: the file and its
   WAL; PostgreSQL: ``pg_database_size``).
4. **retention**: ``store.prune`` of the older day (half the store), in
   batches of 1000 traces per transaction.

    flock /tmp/kvlens-heavy.lock .venv/bin/python benchmarks/bench_store.py \
        [--backend both] [--traces 1000000] [--pg-url postgresql://...] [--repeat 15]

Without ``--pg-url`` a throw-away PostgreSQL server is started for the run
(``tests/pg_server.py``: initdb in a temp dir as the ``postgres`` user, fsync
on, ``synchronous_commit=off`` like SQLite's WAL + ``synchronous=NORMAL``,
``shared_buffers=1GB``) and removed afterwards. With ``--pg-url`` the
database must be empty: the benchmark creates the tables and fills them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, format_trace_id

from dashboard import data as D
from kvtrace import store
from kvtrace.store import testing
from kvrecord import semconv as sc

MS = 1_000_000
GOAL_MS = 200.0


def _span(tid, i, parent, name, role, mode, rid, t0, t1, outcome, attrs):
    return (tid, f"{i:016x}", parent, name, role, mode, rid, t0, t1, outcome, json.dumps(attrs, separators=(",", ":")))


def populate(path, n: int, seed: int = 1, span_h: float = 48.0) -> tuple[int, int]:
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
        a = {
            sc.ATTR_MODE: mode,
            sc.ATTR_BLOCKS: blocks,
            sc.ATTR_BYTES: blocks * 131072,
            sc.ATTR_DESCRIPTORS: blocks * 4,
            sc.ATTR_ENGINE_ID: "p0",
            sc.ATTR_REQUEST_ID: rid,
        }
        ph: list[tuple] = [(P.PREFILL, "prefill", t0 + MS, pf), (P.PREFILL_FINISHED, "prefill", pf, pf)]
        t = pf
        if mode == "push":
            ph += [
                (P.REGISTRATION_STAGE, "decode", t0 + 2 * MS, t0 + 2 * MS),
                (P.REGISTRATION_SEND, "decode", t0 + 2 * MS, t0 + 3 * MS),
                (P.REGISTRATION_RECEIVE, "prefill", t0 + 4 * MS, t0 + 4 * MS),
                (P.MATCH, "prefill", t0 + 4 * MS, pf),
            ]
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
        spans.append(
            _span(
                tid,
                sid,
                None,
                P.REQUEST.value,
                "router",
                mode,
                tid,
                t0,
                end,
                outcome,
                {sc.ATTR_MODE: mode, sc.ATTR_TTFT_S: ttft, sc.ATTR_DISPATCH: "overlapped"},
            )
        )
        sid += 1
        aj = json.dumps(a, separators=(",", ":"))  # one encoding per trace: generation, not the store, is timed
        for name, role, s0, s1 in ph:
            spans.append(
                (
                    tid,
                    f"{sid:016x}",
                    root,
                    name.value,
                    role,
                    mode,
                    rid,
                    s0,
                    s1,
                    outcome if name in (P.WRITE_COMPLETE, P.READ_COMPLETE) else "ok",
                    aj,
                )
            )
            sid += 1
        n_spans += 1 + len(ph)
        traces.append(
            (
                tid,
                tid,
                mode,
                "overlapped" if mode == "push" else "sequential",
                outcome,
                t0,
                end,
                ttft,
                pf,
                kv,
                1 + len(ph),
                (kv - pf) / 1e9 if kv else None,
                0.001 if kv else None,
            )
        )
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


# ------------------------------------------------------------------ ingest
def _wire_spans(n_traces: int, seed: int, t_base: int) -> list:
    """SDK ``ReadableSpan`` s, as the collector decodes them and writes them:
    push and pull requests with router, P and D spans, clock crossings and
    both ends of the handoff, so the writer folds and settles as in production."""
    rng = random.Random(seed)
    P = sc.Phase
    out = []
    for k in range(n_traces):
        mode = "push" if k % 2 == 0 else "pull"
        tid = rng.getrandbits(128)
        rid = f"cmpl-{tid:032x}-0-{rng.getrandbits(32):08x}"
        t0 = t_base + k * 2 * MS
        pf = t0 + int(rng.uniform(20, 80) * MS)
        root = SpanContext(tid, rng.getrandbits(64), False)

        def span(name, role, s0, s1, extra=None):
            a = {
                sc.ATTR_ROLE: role,
                sc.ATTR_MODE: mode,
                sc.ATTR_OUTCOME: "ok",
                sc.ATTR_REQUEST_ID: tid if role == "router" else rid,
                sc.ATTR_ENGINE_ID: {"prefill": "p0", "decode": "d0"}.get(role),
                **(extra or {}),
            }
            out.append(
                ReadableSpan(
                    context=SpanContext(tid, rng.getrandbits(64), False),
                    parent=root,
                    name=name.value,
                    attributes={k: v for k, v in a.items() if v is not None},
                    start_time=s0,
                    end_time=s1,
                )
            )

        span(P.PREFILL, "prefill", t0 + MS, pf, {sc.ATTR_TOKENS: 512})
        span(P.PREFILL_FINISHED, "prefill", pf, pf)
        if mode == "push":
            span(P.REGISTRATION_SEND, "decode", t0 + 2 * MS, t0 + 3 * MS)
            span(P.REGISTRATION_RECEIVE, "prefill", t0 + 4 * MS, t0 + 4 * MS)
            span(P.MATCH, "prefill", t0 + 4 * MS, pf)
            t = pf
            for name in (P.DESCRIPTOR_PREP, P.WRITE_POST, P.WRITE_COMPLETE):
                d = int(rng.uniform(0.2, 6) * MS)
                span(name, "prefill", t, t + d, {sc.ATTR_BLOCKS: 8})
                t += d
        else:
            t = pf + MS
            span(P.ALLOC, "decode", t, t)
            for name in (P.DESCRIPTOR_PREP, P.READ_POST, P.READ_COMPLETE):
                d = int(rng.uniform(0.2, 8) * MS)
                span(name, "decode", t, t + d, {sc.ATTR_BLOCKS: 8})
                t += d
        kv = t + int(rng.uniform(0.2, 1) * MS)
        span(P.KV_READY, "decode", kv, kv)
        out.append(
            ReadableSpan(
                context=root,
                parent=None,
                name=P.REQUEST.value,
                attributes={
                    sc.ATTR_ROLE: "router",
                    sc.ATTR_MODE: mode,
                    sc.ATTR_OUTCOME: "ok",
                    sc.ATTR_REQUEST_ID: format_trace_id(tid),
                    sc.ATTR_TTFT_S: (kv - t0) / 1e9,
                    sc.ATTR_DISPATCH: "overlapped",
                },
                start_time=t0,
                end_time=kv + 40 * MS,
            )
        )
    return out


def _writer(name, n_traces: int, seed: int, barrier, results) -> None:
    """One writer process: build its spans, wait for the others, write them
    in batches of 2000 on one connection (as the collector's writer does)."""
    spans = _wire_spans(n_traces, seed, time.time_ns() - 3600 * 10**9)
    conn = store.connect(name)
    barrier.wait()
    t = time.perf_counter()
    for i in range(0, len(spans), 2000):
        store.write_spans(conn, spans[i : i + 2000])
    results.put((len(spans), time.perf_counter() - t, t))
    conn.close()


def ingest(name, writers: int, traces_per_writer: int) -> float:
    """Spans/s with ``writers`` processes writing at once (wall time from the
    common start to the last writer's end)."""
    ctx = mp.get_context("spawn")  # no fork of a process holding pool threads
    barrier, results = ctx.Barrier(writers), ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(name, traces_per_writer, 100 + w + writers * 10, barrier, results))
        for w in range(writers)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    start = min(g[2] for g in got)
    end = max(g[2] + g[1] for g in got)
    return sum(g[0] for g in got) / (end - start)


# ------------------------------------------------------------------- reads
def reads(name, repeat: int) -> tuple[list, dict]:
    conn = store.connect(name, readonly=True)
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
    for case, kw in cases.items():
        ms, res = timeit(lambda kw=kw: store.slowest(conn, 50, **kw), repeat)
        rows.append((case, ms, len(res)))
    tid = push["trace_id"]
    ms, res = timeit(lambda: store.spans_for(conn, [tid]), repeat)
    rows.append(("spans_for(one trace)", ms, len(res[tid])))
    ms, res = timeit(lambda: D.trace_detail(name, tid), repeat)
    rows.append(("dashboard trace_detail (waterfall)", ms, len(res[1])))
    ms, res = timeit(lambda: D.window_traces(name, h1, now), max(3, repeat // 3))
    rows.append(("dashboard window_traces 1h", ms, len(res)))
    ms, res = timeit(lambda: D.phase_breakdown(name, h1, now), max(3, repeat // 3))
    rows.append(("dashboard phase_breakdown 1h (5k sample)", ms, len(res)))
    ms, res = timeit(lambda: D.store_info(name), max(3, repeat // 3))
    rows.append(("dashboard store_info", ms, res["traces"]))
    plans = {case: store.slowest_plan(conn, 50, **kw) for case, kw in cases.items()}
    conn.close()
    return rows, plans


def run_backend(label: str, name, args) -> dict:
    out: dict = {"backend": label}
    print(f"\n===== {label}: {store.StoreLocation.parse(name)}", flush=True)
    store.connect(name).close()
    for w in (1, 4):
        out[f"ingest_{w}w"] = ingest(name, w, args.ingest_traces // w)
        print(f"ingest, {w} writer(s): {out[f'ingest_{w}w']:,.0f} spans/s", flush=True)
    before = testing.store_bytes(name)
    t = time.perf_counter()
    n_tr, n_sp = populate(name, args.traces)
    wr = time.perf_counter() - t
    out.update(populate_s=wr, traces=n_tr, spans=n_sp)
    size = testing.store_bytes(name)
    out["mb_per_1m"] = (size - before) / 1e6 * 1e6 / max(n_tr, 1)  # what the populated traces added
    print(
        f"populated {n_tr:,} traces / {n_sp:,} spans in {wr:.0f} s ({n_sp / wr:,.0f} spans/s, bulk); "
        f"store {size / 1e6:,.0f} MB = {out['mb_per_1m']:,.0f} MB per million traces",
        flush=True,
    )
    rows, plans = reads(name, args.repeat)
    out["reads"] = rows
    print(f"\n{'read':48s} {'median ms':>10s} {'rows':>8s}")
    for case, ms, n in rows:
        flag = "  <-- over goal" if (case.startswith(("slowest", "spans_for")) and ms > GOAL_MS) else ""
        print(f"{case:48s} {ms:10.1f} {n:8d}{flag}")
    print("\nquery plans:")
    for case, plan in plans.items():
        print(f"  {case:44s} {plan}")
    conn = store.connect(name)
    cutoff = time.time_ns() - 24 * 3600 * 10**9
    t = time.perf_counter()
    deleted = store.prune(conn, cutoff, batch=1000)
    out["prune_s"], out["pruned"] = time.perf_counter() - t, deleted
    conn.close()
    print(
        f"\nretention: deleted {deleted:,} traces (the older day) in {out['prune_s']:.1f} s "
        f"({deleted / max(out['prune_s'], 1e-9):,.0f} traces/s, batches of 1000)",
        flush=True,
    )
    return out


def summary(results: list[dict]) -> None:
    print("\n===== side by side")
    cols = [r["backend"] for r in results]
    print(f"{'':44s}" + "".join(f"{c:>14s}" for c in cols))

    def line(label, fmt, get):
        print(f"{label:44s}" + "".join(f"{fmt.format(get(r)):>14s}" for r in results))

    line("ingest spans/s, 1 writer", "{:,.0f}", lambda r: r["ingest_1w"])
    line("ingest spans/s, 4 writers", "{:,.0f}", lambda r: r["ingest_4w"])
    line("traces in the store", "{:,}", lambda r: r["traces"])
    line("bulk load (s)", "{:,.0f}", lambda r: r["populate_s"])
    for case in (
        "slowest 50 (no filter)",
        "slowest 50 mode=push",
        "slowest 50 mode=pull outcome=failed",
        "slowest 50 mode=push since 1h",
        "spans_for(one trace)",
        "dashboard trace_detail (waterfall)",
    ):
        line(f"{case} ms", "{:.1f}", lambda r, c=case: next(ms for n, ms, _ in r["reads"] if n == c))
    line("worst slowest-50 ms", "{:.1f}", lambda r: max(ms for n, ms, _ in r["reads"] if n.startswith("slowest")))
    line("MB per million traces", "{:,.0f}", lambda r: r["mb_per_1m"])
    line("delete one day (s)", "{:.1f}", lambda r: r["prune_s"])
    line("traces deleted", "{:,}", lambda r: r["pruned"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="both")
    ap.add_argument("--traces", type=int, default=1_000_000, help="traces in the store for the reads")
    ap.add_argument(
        "--ingest-traces",
        type=int,
        default=8000,
        help="traces (x ~11 spans) written through write_spans per ingest run, split over the writers",
    )
    ap.add_argument("--pg-url", default=None, help="an empty PostgreSQL database (default: a throw-away server)")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)

    results = []
    tmp = tempfile.TemporaryDirectory(prefix="kvlens-bench-")
    server = None
    try:
        if args.backend in ("sqlite", "both"):
            results.append(run_backend("sqlite", Path(tmp.name) / "traces.db", args))
        if args.backend in ("postgresql", "both"):
            url = args.pg_url
            if url is None:
                sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
                from pg_server import PgServer

                server = PgServer(durable=True, shared_buffers="1GB").init().start()
                url = server.new_database("bench")
            results.append(run_backend("postgresql", url, args))
        summary(results)
    finally:
        from kvtrace.store import pg

        pg.close_pools()
        if server is not None:
            server.remove()
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
