"""Serving overhead of the instrumented connector vs vLLM's own, same
workload, side by side in one run:

    .venv/bin/python benchmarks/bench_overhead.py [--mode push] [--rounds 4] [--requests 40]

Each round starts the stock pair and the instrumented pair in turn (ABBA
order across rounds), and sends each the same prompts one request at a time
(closed loop: no queueing to amplify a stall). Two pairs cannot run at once
on a 2-core box: the second one's start-up starves behind the first one's
NIXL progress threads (each idle vLLM worker spins a core) and times out.

Prints per-round medians, the ratio of pooled medians, and the spread of the
per-round ratios: on a noisy machine the spread between two start-ups of the
same pair is the number to read before any ratio. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvlens import bench
from kvlens.up import Stack

LABELS = ("stock", "instrumented")
METRICS = ("ttft_s", "tpot_s", "latency_s")


async def _closed_loop(url: str, prompts: list[str], a) -> list:
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.request_timeout, connect=10)) as client:
        for i, prompt in enumerate(prompts):
            r = await bench.one_request(client, url, None, prompt, a.output_len, bench.new_request_id())
            if i >= a.warmup:
                out.append(r)
    return out


def _med(results: list, metric: str) -> float | None:
    vals = [getattr(r, metric) for r in results if r.ok and getattr(r, metric) is not None]
    return statistics.median(vals) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="push", choices=["push", "pull"])
    ap.add_argument("--rounds", type=int, default=4, help="start-ups of each pair (default 4)")
    ap.add_argument("--requests", type=int, default=40, help="measured requests per pair per round (default 40)")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured requests first (default 4)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    a = ap.parse_args()
    if a.rounds < 1 or a.requests < 3 or a.input_len < 1 or a.output_len < 2:
        ap.error("need --rounds >= 1, --requests >= 3, --input-len >= 1, --output-len >= 2")
    signal.signal(signal.SIGTERM, bench._on_term)  # unwind like Ctrl-C: the pair is stopped

    home = Path(tempfile.mkdtemp(prefix="kvlens-overhead-"))
    from kvlens.model import ensure_model

    model = ensure_model(home / "model")
    maker = bench.PromptMaker(model)
    rng = bench._rng(a.seed)  # numpy Generator, as kvlens bench uses
    prompts = [maker.make(a.input_len, rng) for _ in range(a.warmup + a.requests)]
    res: dict[str, list[list]] = {k: [] for k in LABELS}
    t0 = time.monotonic()
    try:
        for rnd in range(a.rounds):
            order = LABELS if rnd % 2 == 0 else LABELS[::-1]
            for label in order:
                stack = Stack(mode=a.mode, stock=(label == "stock"), model=model, port=None, kvlens_home=home,
                              quiet=True, vllm_args=["--no-enable-prefix-caching"])
                try:
                    stack.start()
                    rs = asyncio.run(_closed_loop(stack.router_url, prompts, a))
                finally:
                    bench._stop_quietly(stack)
                res[label].append(rs)
                line = "  ".join(f"{m}={(_med(rs, m) or 0) * 1e3:.1f}ms" for m in METRICS)
                print(f"round {rnd} {label:12s} {line} failed={sum(not r.ok for r in rs)} "
                      f"({time.monotonic() - t0:.0f}s)", flush=True)
    except KeyboardInterrupt:
        print("interrupted; the pair was stopped", file=sys.stderr)
        if not all(res.values()):
            return 130
    n = min(len(v) for v in res.values())
    print(f"\nmode={a.mode} input={a.input_len} output={a.output_len} rounds={n} requests/round={a.requests}")
    for m in METRICS:
        pooled = {k: _med([r for rs in v[:n] for r in rs], m) for k, v in res.items()}
        per_round = [(_med(i, m) or 0) / (_med(s, m) or 1) for s, i in zip(res["stock"][:n], res["instrumented"][:n])]
        if not pooled["stock"] or not pooled["instrumented"]:
            print(f"{m:9s} no successful requests")
            continue
        print(f"{m:9s} stock={pooled['stock'] * 1e3:8.2f}ms  instrumented={pooled['instrumented'] * 1e3:8.2f}ms  "
              f"ratio={pooled['instrumented'] / pooled['stock']:.3f}  per-round ratios "
              f"{', '.join(f'{x:.2f}' for x in per_round)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
