"""Benchmark ``kvlens collect`` ingest (figures only, no assertions).

    .venv/bin/python benchmarks/bench_collector.py [--bodies 40] [--spans-per-body 500] [--rounds 3] [--no-live]

OTLP/HTTP protobuf bodies of realistic kvlens spans (push and pull requests
from router, P and D, with the attributes the connector records), each
stage on its own and end to end; medians over ``--rounds``, CPU time per
span from the process clock (all threads), so a busy machine shows in the
wall figures but much less in the CPU ones:

1. decode: body -> ReadableSpans (:func:`exporters.collector.otlp.decode`);
2. store: :func:`kvtrace.store.write_spans` of the decoded spans, in the
   collector's batches (2000), fresh traces each round;
3. metrics: :class:`~exporters.metrics.PhaseMetricsProcessor` ``on_end`` per
   span (what ``collector_ingest`` adds after each write);
4. in-process app: POST every body through the ASGI app (Starlette
   TestClient) into ``collector_ingest`` (queue, writer thread, store,
   metrics) until the queue is empty;
5. live: a real ``kvlens collect`` subprocess fed over HTTP (keep-alive);
   its own CPU time per span from ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from prometheus_client import CollectorRegistry

from kvtrace import store
from exporters.collector import otlp
from exporters.collector.ingest import collector_ingest
from exporters.metrics import PhaseMetricsProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvspans import Fleet  # noqa: E402

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


def bench_decode(bodies: list[bytes]) -> tuple[float, float, list]:
    out: list = []
    cpu, wall = _cpu_wall(lambda: [out.extend(otlp.decode(b, otlp.PROTOBUF)) for b in bodies])
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


def bench_app(bodies: list[bytes], path: Path) -> tuple[float, float]:
    from starlette.testclient import TestClient

    from exporters.collector.app import create_app

    reg = CollectorRegistry()
    ing = collector_ingest(path, reg, max_queue_spans=10**7, handoff_deadline_s=1.0)
    with TestClient(create_app(ing, reg)) as client:

        def run():
            for b in bodies:
                r = client.post("/v1/traces", content=b, headers=PB)
                if r.status_code != 200:
                    raise SystemExit(f"collector answered {r.status_code}: {r.text[:200]}")
            while ing.queued_spans:
                time.sleep(0.001)

        return _cpu_wall(run)


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _written(client, base: str) -> int:
    text = client.get(base + "/metrics").text
    return int(float(re.search(r"^kvlens_collector_spans_written_total (\S+)", text, re.M).group(1)))


def bench_live(rounds: list[list[bytes]], path: Path) -> list[tuple[int, float, float]]:
    """(spans, collector CPU s, wall s) per round against a real ``kvlens collect``."""
    import httpx

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvlens.cli",
            "collect",
            "--port",
            "0",
            "--store",
            str(path),
            "--queue-spans",
            str(10**7),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        m = re.search(r"(http://\S+)/v1/traces", proc.stdout.readline())
        if not m:
            raise SystemExit("kvlens collect did not start")
        base, out = m.group(1), []
        with httpx.Client(timeout=60) as client:
            for bodies in rounds:
                c0, w0 = _proc_cpu(proc.pid), time.perf_counter()
                before = _written(client, base)
                for b in bodies:
                    r = client.post(base + "/v1/traces", content=b, headers=PB)
                    r.raise_for_status()
                while client.get(base + "/healthz").json()["queue_spans"]:
                    time.sleep(0.002)
                cpu, wall = _proc_cpu(proc.pid) - c0, time.perf_counter() - w0
                out.append((_written(client, base) - before, cpu, wall))
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


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
    args = ap.parse_args()
    print(f"building {args.rounds} x {args.bodies} bodies of ~{args.spans_per_body} spans ...", flush=True)
    rounds = [make_bodies(args.bodies, args.spans_per_body) for _ in range(args.rounds)]
    size = statistics.mean(len(b) for b in rounds[0])
    tmp = Path(tempfile.mkdtemp(prefix="kvlens-bench-collector-"))
    res: dict[str, tuple[list, list]] = {k: ([], []) for k in ("decode", "store", "metrics", "app")}
    n = 0
    for r, bodies in enumerate(rounds):
        cpu, wall, spans = bench_decode(bodies)
        n = len(spans)
        res["decode"][0].append(cpu), res["decode"][1].append(wall)
        for key, fn in (("store", bench_store), ("metrics", bench_metrics)):
            c, w = fn(spans, tmp / f"{key}-{r}.db")
            res[key][0].append(c), res[key][1].append(w)
        c, w = bench_app(bodies, tmp / f"app-{r}.db")
        res["app"][0].append(c), res["app"][1].append(w)
    print(
        f"{n} spans per round ({args.bodies} bodies, {size / 1024:.0f} KiB, {size / (n / args.bodies):.0f} B/span);"
        f" medians of {args.rounds} rounds; python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    _line("1 decode (pb -> ReadableSpan)", n, *res["decode"])
    _line("2 store.write_spans (2000/batch)", n, *res["store"])
    _line("3 metrics on_end", n, *res["metrics"])
    _line("4 in-process app end to end", n, *res["app"])
    if not args.no_live:
        live = bench_live(rounds, tmp / "live.db")
        cpus, walls = [c for _, c, _ in live], [w for _, _, w in live]
        _line("5 live kvlens collect (its CPU)", live[0][0], cpus, walls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
