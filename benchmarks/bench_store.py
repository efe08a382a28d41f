"""Trace-store benchmark, SQLite vs PostgreSQL side by side: ingest, the
dashboard's reads at size, store size, retention.

Per backend (``--backend sqlite|postgresql|both``):

1. **ingest**: spans/s through the writer the collector uses
   (``store.write_spans``: folding, upserts, the settle pass), batches of
   2000 spans, with one writer process and with four writing at once
   (several collectors / vLLM processes on one store).
2. **bytes** per request at each ``--keep-ratios`` (default 1, 0.1, 0.01:
   every request keeps its summary row, with ``keep`` and its phase
   durations; its spans with that probability), one fresh store per ratio,
   tables and every index counted, with each relation's share
   (``store_bytes.py``). Goal: <= 1 KB per request on PostgreSQL at 1 %.
3. **reads**: populate N requests (``--traces``, default 200 000, ~11
   spans each) over 48 h with ``store.bulk_insert`` (SQLite: executemany;
   PostgreSQL: COPY), time the reads the dashboard and ``kvlens traces``
   make (medians) and print the query plans (``store.slowest_plan``).
   Goal: ``slowest 50`` and one trace's waterfall under 200 ms.
4. **retention** of the older day while another connection writes:
   PostgreSQL drops the whole days (partitions, detached concurrently),
   timed alone, with the writer's worst batch meanwhile; then the rest
   before the horizon in batches. SQLite: batched deletes.

    flock /tmp/kvlens-heavy.lock .venv/bin/python benchmarks/bench_store.py \
        [--backend both] [--traces 200000] [--keep-ratios 1,0.1,0.01] \
        [--parts ingest,bytes,reads,retention] [--pg-url postgresql://...] [--repeat 15]

Without ``--pg-url`` a throw-away PostgreSQL server is started for the run
(``tests/pg_server.py``: initdb in a temp dir as the ``postgres`` user, fsync
on, ``synchronous_commit=off`` like SQLite's WAL + ``synchronous=NORMAL``,
``shared_buffers=1GB``) and removed afterwards. With ``--pg-url`` the
database must be empty: the benchmark creates the tables and fills them
(and, for the bytes part, one database per ratio on the same server).
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
from kvtrace.store.columns import SUMMARY_PHASES, phase_column
from kvrecord import semconv as sc

import store_bytes
import store_sql  # store_bytes put tests/ on sys.path

MS = 1_000_000
GOAL_MS = 200.0


def _span(tid, i, parent, name, role, mode, rid, t0, t1, outcome, attrs):
    return (tid, f"{i:016x}", parent, name, role, mode, rid, t0, t1, outcome, json.dumps(attrs, separators=(",", ":")))


#: A synthetic request's summary row: the written columns, the keep decision, one duration per phase.
SUMMARY_ROW = (*store.TRACE_COLUMNS, "keep", *(phase_column(p) for p in SUMMARY_PHASES))
_PHASE_AT = {p: i for i, p in enumerate(SUMMARY_PHASES)}


def _durations(root_s: float, ph: list[tuple]) -> list:
    """The summary's phase durations (the longest copy of each), SUMMARY_PHASES order."""
    out: list = [None] * len(SUMMARY_PHASES)
    out[_PHASE_AT[sc.Phase.REQUEST.value]] = root_s
    for name, _, s0, s1 in ph:
        i = _PHASE_AT.get(name.value)
        if i is not None:
            out[i] = max(out[i] or 0.0, (s1 - s0) / 1e9)
    return out


def populate(path, n: int, seed: int = 1, span_h: float = 48.0, keep_ratio: float = 1.0) -> tuple[int, int]:
    """Write ``n`` traces spread over the last ``span_h`` hours, each with its
    summary row (``keep``: ``all`` at ratio 1, else ``ratio`` or ``no``, and
    its phase durations); a request keeps its spans with probability
    ``keep_ratio``. Returns (traces, spans stored)."""
    rng = random.Random(seed)
    keep_rng = random.Random(seed + 1)  # the decision draws apart: the same traces at every ratio
    conn = store.connect(path, durable=False)
    now = time.time_ns()
    base = now - int(span_h * 3600e9)
    step = int(span_h * 3600e9 / n)
    spans, traces, n_spans = [], [], 0
    sid = 1
    P = sc.Phase

    def flush():
        nonlocal spans, traces
        store.bulk_insert(conn, spans, traces, SUMMARY_ROW)  # one transaction per batch
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
        kept = keep_ratio >= 1.0 or keep_rng.random() < keep_ratio
        first = len(spans)
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
        if kept:
            n_spans += 1 + len(ph)
        else:
            del spans[first:]  # summary only
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
                ("all" if keep_ratio >= 1.0 else "ratio") if kept else "no",
                *_durations((end - t0) / 1e9, ph),
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


def run_backend(label: str, name, args, make_store) -> dict:
    out: dict = {"backend": label}
    print(f"\n===== {label}: {store.StoreLocation.parse(name)}", flush=True)
    store.connect(name).close()
    if "ingest" in args.parts:
        for w in (1, 4):
            out[f"ingest_{w}w"] = ingest(name, w, args.ingest_traces // w)
            print(f"ingest, {w} writer(s): {out[f'ingest_{w}w']:,.0f} spans/s", flush=True)
    if "bytes" in args.parts:
        out["bytes"] = store_bytes.bytes_per_request(label, make_store, populate, args.keep_ratios, args.traces)
    if "reads" not in args.parts and "retention" not in args.parts:
        return out
    before = store_sql.store_bytes(name)
    t = time.perf_counter()
    n_tr, n_sp = populate(name, args.traces)
    wr = time.perf_counter() - t
    out.update(populate_s=wr, traces=n_tr, spans=n_sp)
    size = store_sql.store_bytes(name)
    out["mb_per_1m"] = (size - before) / 1e6 * 1e6 / max(n_tr, 1)  # what the populated traces added
    print(
        f"populated {n_tr:,} traces / {n_sp:,} spans in {wr:.0f} s ({n_sp / wr:,.0f} spans/s, bulk); "
        f"store {size / 1e6:,.0f} MB = {out['mb_per_1m']:,.0f} MB per million traces",
        flush=True,
    )
    if "reads" in args.parts:
        rows, plans = reads(name, args.repeat)
        out["reads"] = rows
        print(f"\n{'read':48s} {'median ms':>10s} {'rows':>8s}")
        for case, ms, n in rows:
            flag = "  <-- over goal" if (case.startswith(("slowest", "spans_for")) and ms > GOAL_MS) else ""
            print(f"{case:48s} {ms:10.1f} {n:8d}{flag}")
        print("\nquery plans:")
        for case, plan in plans.items():
            print(f"  {case:44s} {plan}")
    if "retention" in args.parts:
        out["retention"] = r = store_bytes.drop_with_writer(
            name, time.time_ns() - 24 * 3600 * 10**9, _wire_spans(3000, 7, time.time_ns())
        )
        whole = "whole days (partitions)" if label == "postgresql" else "all (batched deletes)"
        print(
            f"\nretention of the older day, a writer writing 200-span batches meanwhile:\n"
            f"  {whole}: {r['days_dropped_traces']:,} traces in {r['drop_days_s']:.3f} s, "
            f"the writer's worst batch meanwhile {r['writer_max_ms_during_drop']:.0f} ms\n"
            f"  the rest before the horizon, batches of 1000: {r['batched_traces']:,} traces in {r['batched_s']:.1f} s\n"
            f"  writer: {r['writer_batches']} batches, median {r['writer_p50_ms']:.0f} ms, worst {r['writer_max_ms']:.0f} ms",
            flush=True,
        )
    return out


def summary(results: list[dict]) -> None:
    print("\n===== side by side")
    cols = [r["backend"] for r in results]

    def line(label, fmt, get):
        print(f"{label:44s}" + "".join(f"{fmt.format(get(r)):>14s}" for r in results))

    if any("bytes" in r for r in results):
        store_bytes.print_bytes_table({r["backend"]: r["bytes"] for r in results if "bytes" in r})
    if not all("reads" in r and "ingest_1w" in r and "retention" in r for r in results):
        return
    print(f"\n{'':44s}" + "".join(f"{c:>14s}" for c in cols))
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
    line("drop whole days (s; SQLite: batched)", "{:.3f}", lambda r: r["retention"]["drop_days_s"])
    line("traces in those days", "{:,}", lambda r: r["retention"]["days_dropped_traces"])
    line("writer's worst batch during it (ms)", "{:.0f}", lambda r: r["retention"]["writer_max_ms_during_drop"])


def _ratios(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ratios: {text!r}") from None
    if not out or any(not 0 < r <= 1 for r in out):
        raise argparse.ArgumentTypeError(f"keep ratios must be in (0, 1], got {text!r}")
    return out


def _pg_databases(url: str):
    """A new database per tag on the server of ``url`` (the bytes part)."""
    base, _, _ = url.rpartition("/")

    def make(tag: str) -> str:
        name = f"kvlens_bench_{tag}"
        store_sql.drop_database(url, name)
        store_sql.create_database(url, name)
        return f"{base}/{name}"

    return make


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="both")
    ap.add_argument("--traces", type=int, default=200_000, help="requests in each store (reads, bytes)")
    ap.add_argument(
        "--parts",
        type=lambda v: set(v.split(",")),
        default={"ingest", "bytes", "reads", "retention"},
        help="comma-separated, of ingest,bytes,reads,retention (default: all)",
    )
    ap.add_argument(
        "--keep-ratios",
        type=_ratios,
        default=(1.0, 0.1, 0.01),
        help="keep ratios of the bytes-per-request part (default 1,0.1,0.01)",
    )
    ap.add_argument(
        "--ingest-traces",
        type=int,
        default=8000,
        help="traces (x ~11 spans) written through write_spans per ingest run, split over the writers",
    )
    ap.add_argument("--pg-url", default=None, help="an empty PostgreSQL database (default: a throw-away server)")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)

    bad = args.parts - {"ingest", "bytes", "reads", "retention"}
    if bad:
        ap.error(f"unknown --parts {sorted(bad)}: choose from ingest,bytes,reads,retention")
    results = []
    tmp = tempfile.TemporaryDirectory(prefix="kvlens-bench-")
    server = None
    try:
        if args.backend in ("sqlite", "both"):
            lite = lambda tag: Path(tmp.name) / f"{tag}.db"  # noqa: E731
            results.append(run_backend("sqlite", lite("traces"), args, lite))
        if args.backend in ("postgresql", "both"):
            url = args.pg_url
            if url is None:
                sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
                from pg_server import PgServer

                server = PgServer(durable=True, shared_buffers="1GB").init().start()
                url = server.new_database("bench")
            results.append(run_backend("postgresql", url, args, _pg_databases(url)))
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
