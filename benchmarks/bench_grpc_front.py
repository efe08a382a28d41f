"""Latency of an authenticated OTLP/gRPC export while uploads without a
token are open (issue 42, item 2). Figures only, no assertions.

    .venv/bin/python benchmarks/bench_grpc_front.py [--slow 16] [--exports 60] [--spans-per-body 200] [--deadline 5]

A real ``kvlens collect`` with a token (``$KVLENS_TOKEN``, a SQLite store in
a scratch directory), fed by one gRPC channel as an exporter keeps it. Two
phases on that one collector, each ``--exports`` sequential ``Export`` calls
with the token (a body of ``--spans-per-body`` kvlens-shaped spans each,
fresh trace ids), their median and p90 latency:

1. **baseline**: nothing else in flight;
2. **slow uploads open**: first ``--slow`` client-streaming calls without a
   token on their own channel, each with its headers sent and its message
   not (an upload on its way), kept open for the whole phase.

An export that misses ``--deadline`` seconds counts as a timeout; after 3 in
a row the phase stops (before issue 42 the collector read a call's message
on one of its 4 workers before checking the token, so 4 such uploads held
every worker and every export timed out). ``PYTHONPATH=<older checkout>``
runs the same load on older code.
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
import threading
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # this checkout, not whichever kvlens the venv installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvspans import Fleet  # noqa: E402
from scratch import scratch_dir  # noqa: E402 (benchmarks/: the script's own directory)

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
MS = 1_000_000


def bodies(n: int, per_body: int) -> list[bytes]:
    """``n`` OTLP protobuf bodies of about ``per_body`` spans, fresh trace ids."""
    fleet = Fleet(1, 1, spread_ms=0.0, seed=secrets.randbits(32))
    out, i, t0 = [], 0, time.time_ns() - 60 * 10**9
    for _ in range(n):
        spans: list = []
        while len(spans) < per_body:
            spans += [s for _, s in fleet.request(t0 + i * MS, 0, "push" if i % 2 == 0 else "pull")]
            i += 1
        out.append(encode_spans(spans).SerializeToString())
    return out


def start_collector(token: str, home: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "KVLENS_TOKEN": token, "KVLENS_HOME": str(home)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlens.cli", "collect", "--port", "0", "--grpc-port", "0"]
        + ["--store", str(home / "traces.db"), "--queue-spans", str(10**7)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        # python -m imports from its working directory first: the code under test
        cwd=(os.environ.get("PYTHONPATH") or "").split(os.pathsep)[0] or Path(__file__).resolve().parents[1],
    )
    for _ in range(10):
        line = proc.stdout.readline()
        if m := re.search(r"OTLP/gRPC on https?://(\S+)", line):
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("kvlens collect printed no gRPC address")


def exports(call, token: str, todo: list[bytes], deadline_s: float) -> tuple[list[float], int]:
    """Latencies (ms) of the exports that answered, and how many timed out."""
    md = (("authorization", f"Bearer {token}"),)
    lat, timeouts, in_a_row = [], 0, 0
    for body in todo:
        t = time.perf_counter()
        try:
            call(body, timeout=deadline_s, metadata=md)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            timeouts += 1
            in_a_row += 1
            if in_a_row == 3:
                break
            continue
        in_a_row = 0
        lat.append((time.perf_counter() - t) * 1000)
    return lat, timeouts


def _line(label: str, lat: list[float], timeouts: int, asked: int) -> None:
    if lat:
        p90 = statistics.quantiles(lat, n=10)[-1] if len(lat) > 1 else lat[0]
        figs = f"median {statistics.median(lat):7.2f} ms  p90 {p90:7.2f} ms"
    else:
        figs = "no export answered"
    print(f"{label:<34} {figs}  ({len(lat)} of {asked} answered, {timeouts} timed out)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slow", type=int, default=16, help="uploads without a token kept open (default 16)")
    ap.add_argument("--exports", type=int, default=60, help="authenticated exports per phase (default 60)")
    ap.add_argument("--spans-per-body", type=int, default=200)
    ap.add_argument("--deadline", type=float, default=5.0, help="seconds an export may take (default 5)")
    args = ap.parse_args()
    token = "bench-" + secrets.token_hex(16)
    todo = bodies(2 * args.exports + 5, args.spans_per_body)
    proc, target = start_collector(token, scratch_dir("kvlens-bench-grpc-front-"))
    release = threading.Event()

    def never_sent():  # the message of an upload still on its way
        release.wait()
        yield b""

    try:
        channel = grpc.insecure_channel(target)
        call = channel.unary_unary(EXPORT)
        exports(call, token, todo[:5], 30.0)  # warm-up: channel, collector's first decode and store write
        print(
            f"kvlens collect (token required) on {target}; {args.exports} exports of "
            f"{args.spans_per_body} spans each per phase, one channel",
            flush=True,
        )
        lat, tmo = exports(call, token, todo[5 : 5 + args.exports], args.deadline)
        _line("baseline", lat, tmo, args.exports)
        strangers = grpc.insecure_channel(target)
        slow = [
            strangers.stream_unary(EXPORT).future(never_sent(), timeout=600) for _ in range(args.slow)
        ]  # headers sent, no message
        time.sleep(0.5)
        refused = sum(1 for f in slow if f.done() and f.code() == grpc.StatusCode.UNAUTHENTICATED)
        lat, tmo = exports(call, token, todo[5 + args.exports :], args.deadline)
        _line(f"{args.slow} slow uploads without a token", lat, tmo, args.exports)
        print(f"  slow uploads already refused (UNAUTHENTICATED) 0.5 s after they opened: {refused} of {args.slow}")
        release.set()
        for f in slow:
            f.cancel()
        strangers.close()
        channel.close()
    finally:
        release.set()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
