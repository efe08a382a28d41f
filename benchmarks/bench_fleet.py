"""What a request pays when spans go over OTLP to a collector instead of the
local store (figures only, no assertions).

    .venv/bin/python benchmarks/bench_fleet.py [--mode push] [--requests 40] [--rounds 1]

Starts the same pair twice per round, one host (one store) and separate
homes (every span also over OTLP/HTTP to ``kvlens collect``; P's and D's
stores too), one after the other (ABBA order over rounds), sends the same
prompts sequentially through the router and prints client-seen TTFT and
total latency medians per topology and their ratio. Export is off the
serving path (a daemon thread per process), so the expected ratio is 1; on a
shared 2-core box pair placement alone moves TTFT by tens of percent between
start-ups, so read a single round with that in mind.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlens.model import ensure_model  # noqa: E402
from kvlens.stack.launch import Stack  # noqa: E402
from scratch import scratch_dir  # noqa: E402 (benchmarks/: the script's own directory)


def measure(stack: Stack, n: int) -> tuple[list[float], list[float]]:
    ttft, total = [], []
    with httpx.Client(timeout=180) as c:
        for i in range(n):
            body = {"prompt": f"fleet bench {i} " + "token " * 200, "max_tokens": 8, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            first = None
            with c.stream("POST", stack.router_url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if (
                        first is None
                        and line.startswith("data: {")
                        and '"text":"' in line.replace(" ", "")
                        and '"text":""' not in line.replace(" ", "")
                    ):
                        first = time.perf_counter()
            if first is not None:
                ttft.append(first - t0)
            total.append(time.perf_counter() - t0)
    return ttft, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["push", "pull"], default="push")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    home = scratch_dir("kvlens-bench-fleet-")
    model = ensure_model(home / "model")
    res: dict[str, tuple[list[float], list[float]]] = {"one host": ([], []), "separate homes": ([], [])}
    order = []
    for r in range(args.rounds):
        order += [False, True] if r % 2 == 0 else [True, False]
    for separate in order:
        name = "separate homes" if separate else "one host"
        print(f"starting {args.mode} stack: {name} ...", flush=True)
        with Stack(
            mode=args.mode,
            model=model,
            port=0,
            kvlens_home=home / name.replace(" ", "-"),
            quiet=True,
            separate_homes=separate,
        ) as st:
            t, tot = measure(st, args.requests)
        res[name][0].extend(t)
        res[name][1].extend(tot)
        print(
            f"  {name}: TTFT p50 {statistics.median(t) * 1e3:.1f} ms, total p50 "
            f"{statistics.median(tot) * 1e3:.1f} ms over {len(tot)} requests",
            flush=True,
        )
    a, b = res["one host"], res["separate homes"]
    print(f"\n{args.mode}, {args.requests} requests x {args.rounds} round(s) per topology:")
    print(
        f"  TTFT p50: one host {statistics.median(a[0]) * 1e3:.1f} ms, separate homes "
        f"{statistics.median(b[0]) * 1e3:.1f} ms, ratio {statistics.median(b[0]) / statistics.median(a[0]):.3f}"
    )
    print(
        f"  total p50: one host {statistics.median(a[1]) * 1e3:.1f} ms, separate homes "
        f"{statistics.median(b[1]) * 1e3:.1f} ms, ratio {statistics.median(b[1]) / statistics.median(a[1]):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
