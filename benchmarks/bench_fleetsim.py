"""Fleet simulation: how large a fleet one ``kvlens collect`` holds (figures only, no assertions).

    flock /tmp/kvlens-heavy.lock .venv/bin/python benchmarks/bench_fleetsim.py \\
        [--pairs 64] [--routers 4] [--rates 200,500,1000,2000] [--duration 60] \\
        [--store PATH | --pg-url postgresql://...] [--collect-arg=--queue-spans=200000 ...]

A load generator sends what ``--pairs`` (P, D) pairs and ``--routers``
routers would send over OTLP/HTTP protobuf into ONE real ``kvlens collect``
subprocess: kvlens-shaped spans of push and pull requests
(``benchmarks/kvspans.py``: names, attributes, parentage and both clock
crossings of each request), every process with its own resource and its
own batches (a span is exported at its process's next ``--flush-ms`` tick,
or sooner in batches of ``--batch-spans``, as the SDK's batch processor
does), so P's and D's spans of a request arrive in different requests.
Pair k's D clock runs an injected offset ahead of its P's, drawn from
+-``--clock-spread-ms`` (seeded by ``--seed``).

Each rate of ``--rates`` (user requests per second, Poisson arrivals) is a
separate window of ``--duration`` seconds. Its OTLP bodies are built before
the window starts (the generator's CPU per span is printed, and so is its
CPU while sending), then sent on time over ``--connections`` keep-alive
connections (httpx; ``--connections 0``: one per process). A 429/503 or a failed connection is retried as an
OTLP exporter does (Retry-After or 1, 2, 4 ... s, giving up 10 s after the
first attempt, counted). After the window the collector's queue is left to
drain (at most ``--drain-s``). Per window:

* loss: spans generated minus the collector's ``spans_written_total`` and
  ``spans_unkept_total`` deltas (``--keep sampled``: spans of requests kept
  as their summary only), next to its ``dropped_total{reason}`` and
  ``requests_rejected_total{reason}`` and what the generator gave up;
* held: no span lost, the sender on time (its last export started within
  10 % + 1 s of schedule) and the queue drained within max(2 s, 10 %);
* the collector's CPU (utime + stime of all its threads, /proc/<pid>/stat)
  per span and per request, as cores, and its RSS (VmRSS, peak VmHWM);
* the store's growth per hour at that rate (PostgreSQL: pg_database_size,
  and spans / traces with their indexes; SQLite: the file and its WAL),
  extrapolated from the window.

Stepping stops after the first window not held (``--keep-going``: all).
At the end the clock offsets the store recovered per pair (its tightest
[lo, hi] over the pair's requests, read through the store API) are printed
against the injected ones: the offset must lie inside for every pair.

The store: ``--store PATH`` (SQLite), ``--pg-url`` (an empty PostgreSQL
database), or by default a throw-away PostgreSQL server
(``tests/pg_server.py``). ``--collect-arg`` passes a flag to ``kvlens
collect`` (repeatable; write it as ``--collect-arg=--keep=sampled`` or
``--collect-arg="--keep-ratio 0.1"``). The collector and the server are
stopped whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetsim_io import Collector, retries, send_window  # noqa: E402
from kvspans import Fleet, Proc, encode  # noqa: E402
from kvtrace import store  # noqa: E402
from kvtrace.store import queries  # noqa: E402

# tests/store_sql.py: what a benchmark needs beneath the store API
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import store_sql  # noqa: E402


# ---------------------------------------------------------------- schedule
def build_schedule(fleet: Fleet, rate: float, duration: float, flush_s: float, batch: int, base_ns: int) -> dict:
    """Every OTLP body the fleet sends in one window: ``{"bodies": [(send at s,
    body, spans)] sorted, "requests": n, "spans": n}``. Built in time order and
    encoded a second behind, so only that much is held as span objects."""
    rng = fleet.rng
    phase = {p: rng.uniform(0, flush_s) for p in fleet.resources}
    buckets: dict[tuple[Proc, int], list] = collections.defaultdict(list)
    bodies: list[tuple[float, bytes, int]] = []
    n_req = n_spans = 0

    def flush(before: float) -> None:
        for key in [k for k in buckets if phase[k[0]] + k[1] * flush_s < before]:
            tick = phase[key[0]] + key[1] * flush_s
            spans = sorted(buckets.pop(key), key=lambda e: e[0])
            for i in range(0, len(spans), batch):
                part = spans[i : i + batch]
                at = part[-1][0] if len(part) == batch else tick  # a full batch goes at once
                bodies.append((at, encode([s for _, s in part]), len(part)))

    t, next_flush = rng.expovariate(rate), 1.0
    while t < duration:
        mode = "push" if rng.random() < 0.5 else "pull"
        pair = rng.randrange(fleet.pairs)
        for proc, span in fleet.request(base_ns + int(t * 1e9), pair, mode, rng.randrange(fleet.routers)):
            true_end = (span.end_time - base_ns - (fleet.offsets_ns[pair] if proc.role == "decode" else 0)) / 1e9
            buckets[proc, math.ceil((true_end - phase[proc]) / flush_s)].append((true_end, span))
            n_spans += 1
        n_req += 1
        t += rng.expovariate(rate)
        if t > next_flush:
            flush(t - 1.0)  # a request lasts well under a second
            next_flush += 1.0
    flush(float("inf"))
    bodies.sort(key=lambda b: b[0])
    return {"bodies": bodies, "requests": n_req, "spans": n_spans}


# ---------------------------------------------------------------- one window
def _delta(after: dict, before: dict, prefix: str) -> dict[str, int]:
    return {k[len(prefix) :]: int(after[k] - before.get(k, 0)) for k in after if k.startswith(prefix)}


def run_step(col: Collector, location: str, fleet: Fleet, rate: float, args, say) -> dict:
    """One measured window at ``rate`` requests/s; its figures."""
    c0 = time.process_time()
    sched = build_schedule(fleet, rate, args.duration, args.flush_ms / 1e3, args.batch_spans, time.time_ns())
    gen_cpu = time.process_time() - c0
    bodies = sched["bodies"]
    say(
        f"  built {len(bodies):,} bodies ({sched['requests']:,} requests, {sched['spans']:,} spans, "
        f"{sum(len(b) for _, b, _ in bodies) / 2**20:.0f} MiB) in {gen_cpu:.1f} CPU-s "
        f"({gen_cpu / max(1, sched['spans']) * 1e6:.1f} us/span, before the window)"
    )
    m0, cpu0, size0 = col.counters(), col.cpu_s(), store_sql.table_bytes(location)
    sent = asyncio.run(send_window(col.base + "/v1/traces", bodies, args.connections, say))
    del bodies, sched["bodies"]
    t_sent, queue = time.monotonic(), col.queue()
    while queue and time.monotonic() - t_sent < args.drain_s:
        time.sleep(0.2)
        queue = col.queue()
    drain_s = time.monotonic() - t_sent
    t_held = time.monotonic()  # --keep sampled: requests still waiting for their decision (not part of "held")
    while col.counters().get("kvlens_collector_decision_buffer_spans", 0) and time.monotonic() - t_held < 30:
        time.sleep(0.2)
    m1, cpu1, size1 = col.counters(), col.cpu_s(), store_sql.table_bytes(location)
    rss, hwm = col.rss_mb()
    written = int(m1["kvlens_collector_spans_written_total"] - m0.get("kvlens_collector_spans_written_total", 0))
    # --keep sampled: spans of requests kept as their summary only are accounted for, not lost
    unkept = int(m1.get("kvlens_collector_spans_unkept_total", 0) - m0.get("kvlens_collector_spans_unkept_total", 0))
    lags = sorted(sent["lags"]) or [0.0]
    r = {
        "rate": rate,
        "requests": sched["requests"],
        "spans": sched["spans"],
        "posts": len(sent["lags"]),
        "written": written,
        "unkept": unkept,
        "lost": sched["spans"] - written - unkept,
        "gave_up": sent["stats"]["gave_up_spans"],
        "refused": sent["stats"]["refused_spans"],
        "retries": retries(sent["stats"]),
        "dropped": _delta(m1, m0, "kvlens_collector_spans_dropped_total"),
        "rejected": _delta(m1, m0, "kvlens_collector_requests_rejected_total"),
        "queue_left": queue,
        "lag_p99_s": lags[int(0.99 * (len(lags) - 1))],
        "lag_max_s": lags[-1],
        "drain_s": drain_s,
        "cpu_s": cpu1 - cpu0,
        "wall_s": sent["wall_s"] + drain_s,
        "gen_cpu_s": gen_cpu,
        "send_cpu_cores": sent["cpu_s"] / max(1e-9, sent["wall_s"]),
        "rss_mb": rss,
        "hwm_mb": hwm,
        "grew": {k: size1[k] - size0.get(k, 0) for k in size1},
    }
    r["held"] = (
        r["lost"] == 0
        and r["lag_max_s"] <= 0.1 * args.duration + 1.0
        and not queue
        and drain_s <= max(2.0, 0.1 * args.duration)
    )
    return r


def show_step(r: dict, duration: float, say) -> None:
    rej = {k: v for k, v in r["rejected"].items() if v}
    drop = {k: v for k, v in r["dropped"].items() if v}
    say(
        f"  {'HELD' if r['held'] else 'NOT HELD'}: {r['spans']:,} spans sent as {r['posts']:,} exports, "
        f"{r['written']:,} written, {r['unkept']:,} summarised only, lost {r['lost']:,} (generator gave up {r['gave_up']:,}, refused {r['refused']:,}; "
        f"collector dropped {drop or 0}, rejected requests {rej or 0}, {r['retries']:,} retries); "
        f"send lag p99 {r['lag_p99_s'] * 1e3:.0f} ms max {r['lag_max_s']:.2f} s; drained in {r['drain_s']:.1f} s"
    )
    say(
        f"  collector {r['cpu_s'] / max(1, r['spans']) * 1e6:.1f} us CPU/span, "
        f"{r['cpu_s'] / max(1, r['requests']) * 1e6:.0f} us/request, {r['cpu_s'] / r['wall_s']:.2f} cores; "
        f"RSS {r['rss_mb']:.0f} MiB (peak {r['hwm_mb']:.0f}); generator {r['send_cpu_cores']:.2f} cores sending; "
        f"store +{r['grew']['store'] / 2**20:.1f} MiB = {r['grew']['store'] / max(1, r['requests']):,.0f} B/request"
    )


# ---------------------------------------------------------------- clocks
def clock_report(location: str, fleet: Fleet, say) -> int:
    """Per pair: the injected offset against the store's tightest interval;
    returns how many pairs' offsets lie outside it (or have none)."""
    with store.reading(location) as c:
        got = queries.pair_clocks(c)
    bad = 0
    say("\nclock offsets per pair (D minus P), injected vs the store's tightest [lo, hi] over the pair's requests:")
    say(f"  {'pair':<9} {'injected ms':>11} {'lo ms':>10} {'hi ms':>10} {'mid-inj us':>10} {'width us':>9} settled")
    for k, theta_ns in enumerate(fleet.offsets_ns):
        g = got.get((f"p{k}", f"d{k}"), {"n": 0, "settled": 0, "lo_s": None, "hi_s": None})
        theta, lo, hi = theta_ns / 1e9, g["lo_s"], g["hi_s"]
        ok = lo is not None and hi is not None and lo <= theta <= hi
        bad += not ok
        if lo is None or hi is None:
            say(f"  p{k}/d{k:<5} {theta * 1e3:>11.3f} {'-':>10} {'-':>10} {'-':>10} {'-':>9} 0/{g['n']}  OUTSIDE")
            continue
        say(
            f"  p{k}/d{k:<5} {theta * 1e3:>11.3f} {lo * 1e3:>10.3f} {hi * 1e3:>10.3f} "
            f"{((lo + hi) / 2 - theta) * 1e6:>10.1f} {(hi - lo) * 1e6:>9.1f} {g['settled']}/{g['n']}"
            + ("" if ok else "  OUTSIDE")
        )
    say(f"  pairs whose injected offset lies outside the recovered bounds: {bad} of {fleet.pairs}")
    return bad


# ---------------------------------------------------------------- main
def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates takes numbers separated by commas, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"--rates needs rates > 0, got {text!r}")
    return rates


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=64, help="(P, D) pairs in the fleet (default 64)")
    ap.add_argument("--routers", type=int, default=4, help="routers the requests are spread over (default 4)")
    ap.add_argument("--rates", type=_rates, default=[200, 500, 1000, 2000], help="requests/s, one window each")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per window (default 60)")
    ap.add_argument("--clock-spread-ms", type=float, default=50.0, help="D-minus-P offsets drawn from +- this")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--flush-ms", type=float, default=200.0, help="each process's export period (default 200)")
    ap.add_argument("--batch-spans", type=int, default=512, help="largest export batch (default 512)")
    ap.add_argument(
        "--connections",
        type=int,
        default=8,
        help="keep-alive connections to the collector (default 8; 0: one per exporting process, which costs "
        "the generator ~2x the CPU)",
    )
    ap.add_argument("--drain-s", type=float, default=30.0, help="longest wait for the queue after a window")
    ap.add_argument("--keep-going", action="store_true", help="run every rate, also past the first not held")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--store", default=None, metavar="PATH", help="an SQLite store file (default: PostgreSQL)")
    where.add_argument("--pg-url", default=None, help="an empty PostgreSQL database (default: a throw-away server)")
    ap.add_argument(
        "--collect-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for kvlens collect, repeatable: --collect-arg=--keep=sampled",
    )
    args = ap.parse_args(argv)
    args.connections = args.connections or 2 * args.pairs + args.routers
    for name in ("pairs", "routers", "batch_spans", "connections"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.duration <= 0 or args.flush_ms <= 0 or args.clock_spread_ms < 0:
        ap.error("--duration and --flush-ms must be > 0, --clock-spread-ms >= 0")
    return args


def summary(results: list[dict], args, say) -> None:
    say(f"\n{args.pairs} pairs, {args.routers} routers, {args.duration:.0f} s windows; {os.cpu_count()} CPUs")
    head = (
        "req/s",
        "spans/s",
        "lost",
        "gave up",
        "429s",
        "lag max s",
        "drain s",
        "us/span",
        "us/req",
        "cores",
        "RSS MiB",
    )
    say("  " + " ".join(f"{h:>9}" for h in head) + "  store/h     held")
    for r in results:
        cells = (
            f"{r['rate']:.0f}",
            f"{r['spans'] / args.duration:,.0f}",
            f"{r['lost']:,}",
            f"{r['gave_up']:,}",
            f"{r['rejected'].get('queue_full', 0):,}",
            f"{r['lag_max_s']:.2f}",
            f"{r['drain_s']:.1f}",
            f"{r['cpu_s'] / max(1, r['spans']) * 1e6:.1f}",
            f"{r['cpu_s'] / max(1, r['requests']) * 1e6:.0f}",
            f"{r['cpu_s'] / r['wall_s']:.2f}",
            f"{r['rss_mb']:.0f}",
        )
        per_h = r["grew"]["store"] / args.duration * 3600 / 2**30
        say("  " + " ".join(f"{c:>9}" for c in cells) + f"  {per_h:6.1f} GiB  {'yes' if r['held'] else 'NO'}")
    held = [r for r in results if r["held"]]
    if held:
        best = max(held, key=lambda r: r["rate"])
        say(
            f"largest fleet held by one collector here: {args.pairs} pairs x {best['rate'] / args.pairs:.1f} req/s "
            f"each = {best['rate']:.0f} req/s ({best['spans'] / args.duration:,.0f} spans/s)"
        )
    else:
        say("no rate was held (see lost, lag and drain above)")


def _location(args, tmp: Path, servers: list) -> str:
    if args.store:
        return str(Path(args.store).resolve())
    if args.pg_url:
        return args.pg_url
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from pg_server import PgServer, missing_reason

    why = missing_reason()
    if why:
        raise SystemExit(f"bench_fleetsim: no throw-away PostgreSQL server ({why}); give --store PATH or --pg-url")
    servers.append(PgServer(durable=True, shared_buffers="256MB").init())
    servers[-1].start()
    return servers[-1].new_database("fleet")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def say(line: str) -> None:
        print(line, flush=True)

    extra = [part for a in args.collect_arg for part in shlex.split(a)]
    tmp, servers, col, results = Path(tempfile.mkdtemp(prefix="kvlens-fleetsim-")), [], None, []
    try:
        location = _location(args, tmp, servers)
        col = Collector(location, extra)
        say(f"kvlens collect pid {col.pid} at {col.base}, store {location} {' '.join(extra)}".rstrip())
        fleet = Fleet(args.pairs, args.routers, args.clock_spread_ms, args.seed)
        for rate in args.rates:
            say(f"\nwindow: {rate:.0f} requests/s for {args.duration:.0f} s")
            results.append(run_step(col, location, fleet, rate, args, say))
            show_step(results[-1], args.duration, say)
            if not results[-1]["held"] and not args.keep_going:
                say("  not held: stopping here (--keep-going runs every rate)")
                break
        summary(results, args, say)
        bad = clock_report(location, fleet, say)
        return 1 if bad else 0
    finally:
        if col is not None:
            col.stop()
        from kvtrace.store import pg

        pg.close_pools()
        for s in servers:
            s.remove()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
