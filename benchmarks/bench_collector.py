"""Benchmark ``kvlens collect`` ingest (figures only, no assertions).

    .venv/bin/python benchmarks/bench_collector.py [--bodies 40] [--spans-per-body 500] [--rounds 3] [--no-live]
        [--live-only] [--pg]

OTLP/HTTP protobuf bodies of realistic kvlens spans (push and pull requests
from router, P and D, with the attributes the connector records), each
stage on its own and end to end; medians over ``--rounds``, CPU time per
span from the process clock (all threads), so a busy machine shows in the
wall figures but much less in the CPU ones:

1. decode: body -> ReadableSpans (:func:`collector.otlp.decode`,
   the SDK's type) and body -> WireSpans (:func:`collector.wire.decode`,
   what the collector uses);
2. store: :func:`kvtrace.store.write_spans` of the decoded spans, in the
   collector's batches (2000), fresh traces each round;
3. metrics: :class:`~exporters.metrics.PhaseMetricsProcessor` ``on_end`` per
   span (what ``collector_ingest`` adds after each write); 3r: the handoff
   resolver's read-back of every trace (its handoff and derived phases), the
   whole trace model (``tracemodel.find``, what it used to read) beside it;
4. in-process app: POST every body through the ASGI app (Starlette
   TestClient) into ``collector_ingest`` (queue, writer thread, store,
   metrics, handoff resolver) until the queue is empty and every handoff
   resolved; its CPU split by thread (HTTP: the client and the event loop;
   decode: the worker threads; writer: store + metrics; resolver); 4s: the
   same under ``--keep sampled`` (1 %, p99: every summary, few spans);
5. live: a real ``kvlens collect`` subprocess fed over HTTP (keep-alive;
   5g: over OTLP/gRPC, one channel);
   its own CPU time per span from ``/proc/<pid>/stat``, until its queue is
   empty and every request's handoff observed or counted unresolved (the
   CPU of the benchmark's own /metrics scrapes, measured after the round,
   taken out and shown on its own line); 5s:
   the same under ``--keep sampled`` (its defaults: 1 %, p99; the CPU of
   the decisions' wait included, not its wall). ``--pg``: the live
   collectors write a throw-away PostgreSQL server (``tests/pg_server.py``)
   instead of a SQLite file; the server's own CPU is not counted (it runs
   on its own cores in a fleet).

It measures the checkout it sits in; stages that checkout lacks are left
out, so ``PYTHONPATH=<older checkout>`` runs the same load on older code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # this checkout, not whichever kvlens the venv installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from prometheus_client import CollectorRegistry

from kvtrace import store, tracemodel  # noqa: E402
from collector import otlp  # noqa: E402
from collector.ingest import collector_ingest  # noqa: E402
from exporters.metrics import PhaseMetricsProcessor  # noqa: E402
from kvrecord.keeprule import KeepRule  # noqa: E402

try:
    from collector import wire  # noqa: E402
except ImportError:  # an older checkout: ReadableSpans only
    wire = None

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvspans import Fleet  # noqa: E402
from scratch import scratch_dir  # noqa: E402 (benchmarks/: the script's own directory)

MS = 1_000_000
PB = {"content-type": "application/x-protobuf"}


def make_bodies(n_bodies: int, per_body: int) -> list[bytes]:
    """``n_bodies`` OTLP protobuf bodies of about ``per_body`` spans, every
    trace id fresh (whole requests of one pair p0/d0: push and pull
    alternating; the shapes are ``kvspans.Fleet``'s, shared with
    ``bench_fleetsim.py``)."""
    fleet = Fleet(1, 1, spread_ms=0.0, seed=secrets.randbits(32))
    bodies = []
    t0 = time.time_ns() - 60 * 10**9
    i = 0
    for _ in range(n_bodies):
        spans: list = []
        while len(spans) < per_body:
            spans += [s for _, s in fleet.request(t0 + i * MS, 0, "push" if i % 2 == 0 else "pull")]
            i += 1
        bodies.append(encode_spans(spans).SerializeToString())
    return bodies


# ------------------------------------------------------------------ stages
def _cpu_wall(fn) -> tuple[float, float]:
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c, time.perf_counter() - w


def bench_decode(bodies: list[bytes], decode=otlp.decode) -> tuple[float, float, list]:
    out: list = []
    cpu, wall = _cpu_wall(lambda: [out.extend(decode(b, otlp.PROTOBUF)) for b in bodies])
    return cpu, wall, out


def bench_store(spans: list, path: Path) -> tuple[float, float]:
    conn = store.connect(path)
    try:
        return _cpu_wall(lambda: [store.write_spans(conn, spans[i : i + 2000]) for i in range(0, len(spans), 2000)])
    finally:
        conn.close()


def bench_metrics(spans: list, path: Path) -> tuple[float, float]:
    proc = PhaseMetricsProcessor(CollectorRegistry(), store_path=path, handoff_from="off", exemplars=True)
    try:
        return _cpu_wall(lambda: [proc.on_end(s) for s in spans])
    finally:
        proc.shutdown()


def bench_resolver(spans: list, path: Path, whole: bool = False) -> tuple[float, float]:
    """Every trace of ``spans`` (in the store at ``path``) resolved in one
    pass: its handoff and derived phases (``whole``: ``tracemodel.find``, the
    whole trace model read back, alone)."""
    ids = sorted({format(s.context.trace_id, "032x") for s in spans})
    if whole:
        conn = store.connect(path, readonly=True)
        try:
            return _cpu_wall(lambda: tracemodel.find(conn, ids))
        finally:
            conn.close()
    proc = PhaseMetricsProcessor(CollectorRegistry(), store_path=path, handoff_from="any", exemplars=True)
    far = time.monotonic() + 3600
    try:
        for t in ids:
            proc.handoff._pending[t] = ("push", far, 0.0)  # submitted, not yet looked up
        return _cpu_wall(lambda: proc.handoff.resolve_once(expire=False))
    finally:
        proc.shutdown()


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """native thread id -> (its Python name, CPU s so far), this process."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = (names.get(int(tid), "?"), _proc_cpu(f"self/task/{tid}"))
        except OSError:
            pass  # ended
    return out


_GROUPS = (("kvlens-collector-writer", "writer"), ("kvlens-handoff", "resolver"), ("AnyIO worker", "decode"))


def bench_app(bodies: list[bytes], path: Path, keep=None) -> tuple[float, float, dict[str, float]]:
    """(CPU s, wall s, CPU s by thread group) of the in-process app (``keep``: its keep rule)."""
    from starlette.testclient import TestClient

    from collector.app import create_app

    reg = CollectorRegistry()
    ing = collector_ingest(path, reg, max_queue_spans=10**7, handoff_deadline_s=1.0, keep=keep)
    resolver = ing._on_close.__self__.handoff  # the PhaseMetricsProcessor's (a benchmark may look)
    with TestClient(create_app(ing, reg)) as client:
        before = _thread_cpu()

        def run():
            for b in bodies:
                r = client.post("/v1/traces", content=b, headers=PB)
                if r.status_code != 200:
                    raise SystemExit(f"collector answered {r.status_code}: {r.text[:200]}")
            while ing.queued_spans or resolver.pending() or ing.keeper.buffered:
                time.sleep(0.001)

        cpu, wall = _cpu_wall(run)
        groups = dict.fromkeys([g for _, g in _GROUPS] + ["http"], 0.0)
        for tid, (name, c) in _thread_cpu().items():
            group = next((g for prefix, g in _GROUPS if name.startswith(prefix)), "http")
            groups[group] += c - before.get(tid, (name, 0.0))[1]
        return cpu, wall, groups


def _proc_cpu(pid: "int | str") -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metric(text: str, name: str) -> float:
    """The sum of ``name``'s samples in an exposition."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)", text, re.M))


def _received(client, base: str) -> int:
    return int(_metric(client.get(base + "/metrics").text, "kvlens_collector_spans_received_total"))


def _settled(client, base: str) -> bool:
    """Every request's handoff observed or counted unresolved."""
    text = client.get(base + "/metrics").text
    done = _metric(text, "kvlens_handoff_seconds_count") + _metric(text, "kvlens_handoff_unresolved_total")
    return done >= _metric(text, "kvlens_requests_total")


#: The CPU seconds of one /metrics scrape of each live round (taken out of its figure).
SCRAPES: list[float] = []


def _grpc_sender(proc: subprocess.Popen):
    """``send(body)`` over OTLP/gRPC to the collector's printed gRPC address
    (one channel, kept open: as an exporter does), and its closer."""
    import grpc

    m = re.search(r"OTLP/gRPC on https?://(\S+)", proc.stdout.readline())
    if not m:
        raise SystemExit("kvlens collect printed no gRPC address")
    channel = grpc.insecure_channel(m.group(1))
    call = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
    return (lambda body: call(body, timeout=60)), channel.close


def bench_live(
    rounds: list[list[bytes]], path: "Path | str", extra: tuple = (), transport: str = "http"
) -> list[tuple[int, float, float]]:
    """(spans, collector CPU s, wall s) per round against a real ``kvlens
    collect`` (``extra``: more of its arguments, e.g. ``--keep sampled``),
    fed over OTLP/HTTP or (``transport="grpc"``) OTLP/gRPC."""
    import httpx

    grpc_args = ["--grpc-port", "0"] if transport == "grpc" else ["--no-grpc"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlens.cli", "collect", "--port", "0", *grpc_args, "--store", str(path)]
        + ["--queue-spans", str(10**7), *extra],
        stdout=subprocess.PIPE,
        text=True,
        # python -m imports from its working directory first: the code under test
        cwd=(os.environ.get("PYTHONPATH") or "").split(os.pathsep)[0] or Path(__file__).resolve().parents[1],
    )
    try:
        m = re.search(r"(http://\S+)/v1/traces", proc.stdout.readline())
        if not m:
            raise SystemExit("kvlens collect did not start")
        base = m.group(1)
        with httpx.Client(timeout=60) as client, contextlib.ExitStack() as stack:
            if transport == "grpc":
                send, close = _grpc_sender(proc)
                stack.callback(close)
            else:

                def send(body: bytes) -> None:
                    client.post(base + "/v1/traces", content=body, headers=PB).raise_for_status()

            return _live_rounds(proc, client, base, rounds, send)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _live_rounds(proc, client, base: str, rounds: list[list[bytes]], send) -> list[tuple[int, float, float]]:
    """Each round's bodies through ``send``, then wait for the store and the
    handoffs; (spans, collector CPU s less the scrapes', wall s) per round."""
    out = []
    for bodies in rounds:
        c0, w0 = _proc_cpu(proc.pid), time.perf_counter()
        before, scrapes = _received(client, base), 2
        for b in bodies:
            send(b)
        while client.get(base + "/healthz").json()["queue_spans"]:
            time.sleep(0.01)
        while not _settled(client, base):  # once a second: a scrape costs the collector CPU
            time.sleep(1.0)
            scrapes += 1
        cpu, wall = _proc_cpu(proc.pid) - c0, time.perf_counter() - w0
        got = _received(client, base) - before
        # the scrapes this loop made are not the collector's work: their CPU,
        # measured now (the same series), is taken out and shown on its own
        s0 = _proc_cpu(proc.pid)
        for _ in range(5):
            _received(client, base)
        scrape = (_proc_cpu(proc.pid) - s0) / 5
        out.append((got, cpu - scrapes * scrape, wall))
        SCRAPES.append(scrape)
    return out


# ------------------------------------------------------------------ report
def _line(label: str, spans: int, cpus: list[float], walls: list[float]) -> None:
    cpu, wall = statistics.median(cpus), statistics.median(walls)
    print(
        f"  {label:<34} {spans / cpu:>10,.0f} spans/CPU-s  {cpu / spans * 1e6:>7.1f} us CPU/span"
        f"  {spans / wall:>10,.0f} spans/s wall"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bodies", type=int, default=40, help="request bodies per round")
    ap.add_argument("--spans-per-body", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-live", action="store_true", help="skip the kvlens collect subprocess")
    ap.add_argument("--live-only", action="store_true", help="only the kvlens collect subprocess (5, 5s)")
    ap.add_argument("--pg", action="store_true", help="live collectors on a throw-away PostgreSQL server")
    args = ap.parse_args()
    print(f"building {args.rounds} x {args.bodies} bodies of ~{args.spans_per_body} spans ...", flush=True)
    rounds = [make_bodies(args.bodies, args.spans_per_body) for _ in range(args.rounds)]
    size = statistics.mean(len(b) for b in rounds[0])
    tmp = scratch_dir("kvlens-bench-collector-")
    res: dict[str, tuple[list, list]] = {}
    threads: dict[str, list[float]] = {}
    n = 0

    def add(key: str, cpu: float, wall: float) -> None:
        res.setdefault(key, ([], []))[0].append(cpu), res[key][1].append(wall)

    decoders = {"sdk": otlp.decode, **({"wire": wire.decode} if wire is not None else {})}
    for r, bodies in enumerate([] if args.live_only else rounds):
        for kind, decode in decoders.items():
            cpu, wall, spans = bench_decode(bodies, decode)
            n = len(spans)
            add(f"decode {kind}", cpu, wall)
            for key, fn in (("store", bench_store), ("metrics", bench_metrics)):
                add(f"{key} {kind}", *fn(spans, tmp / f"{key}-{kind}-{r}.db"))
        add("resolver whole", *bench_resolver(spans, tmp / f"store-{kind}-{r}.db", whole=True))
        add("resolver", *bench_resolver(spans, tmp / f"store-{kind}-{r}.db"))
        c, w, groups = bench_app(bodies, tmp / f"app-{r}.db")
        add("app", c, w)
        for g, v in groups.items():
            threads.setdefault(g, []).append(v)
        sampled = KeepRule.parse("sampled", 0.01, "p99", wait_s=1.0, grace_s=0.2)
        c, w, groups = bench_app(bodies, tmp / f"app-sampled-{r}.db", keep=sampled)
        add("app sampled", c, w)
        for g, v in groups.items():
            threads.setdefault("sampled " + g, []).append(v)
    n = n or sum(len(wire.decode(b, otlp.PROTOBUF)) for b in rounds[0])
    print(
        f"{n} spans per round ({args.bodies} bodies, {size / 1024:.0f} KiB, {size / (n / args.bodies):.0f} B/span);"
        f" medians of {args.rounds} rounds; python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    labels = {
        "decode sdk": "1 decode (pb -> ReadableSpan)",
        "decode wire": "1w decode (pb -> WireSpan)",
        "store sdk": "2 store.write_spans (2000/batch)",
        "store wire": "2w the same, of WireSpans",
        "metrics sdk": "3 metrics on_end",
        "metrics wire": "3w the same, of WireSpans",
        "resolver whole": "3r- resolver read-back: whole trace",
        "resolver": "3r handoff resolver, one pass",
        "app": "4 in-process app end to end",
        "app sampled": "4s the same, --keep sampled (1 %, p99)",
    }
    for key, label in labels.items():
        if key in res:
            _line(label, n, *res[key])
    for g, v in threads.items():
        cpu = statistics.median(v)
        if cpu <= 0:
            continue
        print(f"     {g + ' threads':<32} {n / cpu:>10,.0f} spans/CPU-s  {cpu / n * 1e6:>7.1f} us CPU/span")
    if not args.no_live:
        with _live_stores(args.pg, tmp) as where:
            _live(rounds, where)
    return 0


@contextlib.contextmanager
def _live_stores(pg: bool, tmp: Path):
    """``where(name)``: a fresh store for one live collector (a SQLite file, or a
    database on one throw-away PostgreSQL server, stopped after)."""
    if not pg:
        yield lambda name: tmp / f"{name}.db"
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from pg_server import PgServer, missing_reason

    if missing_reason():
        raise SystemExit(f"bench_collector: no PostgreSQL server ({missing_reason()})")
    server = PgServer(durable=True, shared_buffers="256MB").init()
    server.start()
    try:
        yield server.new_database
    finally:
        server.stop()


def _live(rounds: list[list[bytes]], where) -> None:
    """Stages 5 and 5s, each on a fresh store ``where(name)``."""
    for label, extra, transport in (
        ("5 live kvlens collect (its CPU)", (), "http"),
        ("5g the same, over OTLP/gRPC", (), "grpc"),
        ("5s the same, --keep sampled", ("--keep", "sampled"), "http"),  # defaults: 1 %, p99
    ):
        SCRAPES.clear()
        live = bench_live(rounds, where(f"live{len(extra)}{transport}"), extra, transport)
        cpus, walls = [c for _, c, _ in live], [w for _, _, w in live]
        _line(label, live[0][0], cpus, walls)
        print(f"     (a /metrics scrape: {statistics.median(SCRAPES) * 1e3:.0f} ms CPU, taken out of the figure)")


if __name__ == "__main__":
    sys.exit(main())
