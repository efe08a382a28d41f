"""Cost of issue 41's CPU accounting on the engine's threads, per call:

* the hooks' clock: ``CpuClock.now`` (timestamp + this thread's CPU-time
  clock + schedstat + PSI, read with the GIL held) against ``time.time_ns``;
* the per-step reading (``CpuClock.sample``);
* a span event through ``CpuRecorder`` (its figures: a ring walk, two
  parses, the lookback) against the plain recorder's append;
* once per request on each EngineCore: where its API server's wait landed
  (``cpufigures.landings`` over a full ring, for ``kv.released`` / ``decode.queue``).

    .venv/bin/python benchmarks/bench_cpuclock.py [--repeats 15]

Prints medians (and min/max) of per-call µs over repeats of 20,000 calls;
never asserted (machines are noisy). Multiply by the calls per request
(printed from a real trace's hook count) and divide by the engine CPU per
request (benchmarks/bench_cpu.py) for kvlens' share.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from instrumented_connector.cputap import CpuRecorder  # noqa: E402
from kvrecord import semconv as sc  # noqa: E402
from kvrecord.cpuclock import CpuClock  # noqa: E402
from kvrecord import cpufigures  # noqa: E402
from kvrecord.recorder import Recorder  # noqa: E402

N = 20_000


def per_call_us(fn, n: int = N) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15, help="repeats of 20,000 calls each (default 15)")
    a = ap.parse_args(argv)
    clock = CpuClock()
    if not clock.enabled:
        print(f"CPU accounting unavailable here: {clock.unknown}")
        return 2
    plain = Recorder(role="prefill", mode="push", capacity=10**9)
    import instrumented_connector.cputap as cputap

    cputap._CLOCK = clock
    wrapped = CpuRecorder(Recorder(role="prefill", mode="push", capacity=10**9))
    for _ in range(300):  # readings in the ring, as an engine thread has them
        clock.sample()
    t0 = clock.now()

    def rec_plain():
        t = time.time_ns()
        plain._q.clear() if len(plain._q) > 50_000 else None
        plain.record(sc.Phase.WRITE_POST, "r", t0, t, "ok", {sc.ATTR_BLOCKS: 4})

    def rec_cpu():
        t = clock.now()
        q = wrapped._rec._q
        q.clear() if len(q) > 50_000 else None
        wrapped.record(sc.Phase.WRITE_POST, "r", t - 200_000, t, "ok", {sc.ATTR_BLOCKS: 4})

    # the upstream (API server) ring full, its wait growing every 3rd step: where it landed over the last second,
    # once per request (P's kv.released, D's decode.queue)
    up = [(t0 - (1024 - i) * 1_000_000, 0, b"", (i // 3) * 100_000) for i in range(1024)]
    clock.rings[-1] = collections.deque(up, maxlen=1024)

    def landings():
        cpufigures.landings(clock.rings.get(-1), t0, 1_000_000_000)

    plain._thread = wrapped._rec._thread = object()  # no background thread: the append alone
    rows = {
        "time.time_ns": time.time_ns,
        "CpuClock.now": clock.now,
        "CpuClock.sample (per step)": clock.sample,
        "span event, plain (time_ns + record)": rec_plain,
        "span event, CPU figures (now + CpuRecorder.record)": rec_cpu,
        "API server's wait landings (per request)": landings,
    }
    res = {k: [per_call_us(f) for _ in range(a.repeats)] for k, f in rows.items()}
    print(f"per call, µs (median [min-max] of {a.repeats} x {N}):")
    for k, v in res.items():
        print(f"  {k:<52} {statistics.median(v):6.2f} [{min(v):.2f}-{max(v):.2f}]")
    print(f"readings dropped as smeared: {clock.smeared}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
