"""Serving overhead of the instrumented connector vs vLLM's own, same
workload, side by side in one run:

    .venv/bin/python benchmarks/bench_overhead.py [--mode push] [--rounds 4] [--requests 40]
    .venv/bin/python benchmarks/bench_overhead.py --together [--requests 200]

Default (rounds): each round starts the stock pair and the instrumented pair
in turn (ABBA order across rounds) and sends each the same prompts one
request at a time (closed loop). Prints per-round medians, the ratio of
pooled medians and the per-round ratios: the spread between two start-ups
of the same pair is the number to read before any ratio.

``--together``: both pairs alive at once, each prompt sent to both, one
request at a time, in alternating order (A B, B A, ...), so both see the
same machine at the same moment and start-up differences cancel within
each pair of requests. Prints the ratio of medians with a bootstrap 95 %
interval and the median of per-prompt ratios. On 2 cores the second pair
starts slowly next to a live one: 3 min in one run, not within 10 min in
another (900 s allowed). Run it both ways (``--start-first``) where it can.

Nothing is asserted: a shared machine is noisy; the spread says how noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from kvrecord.ids import new_trace_id
from kvlens.bench.load import one_request
from scratch import scratch_dir  # noqa: E402 (benchmarks/: the script's own directory)
from kvlens.bench.prompts import PromptMaker
from kvlens.bench.prompts import rng as seeded_rng
from kvlens.signals import sigterm_as_interrupt
from kvlens.stack.supervise import signals_ignored
from kvlens.stack.launch import Stack

LABELS = ("stock", "instrumented")
METRICS = ("ttft_s", "tpot_s", "latency_s")


async def _closed_loop(url: str, prompts: list[str], a) -> list:
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.request_timeout, connect=10)) as client:
        for i, prompt in enumerate(prompts):
            r = await one_request(client, url, None, prompt, a.output_len, new_trace_id())
            if i >= a.warmup:
                out.append(r)
    return out


def _med(results: list, metric: str) -> float | None:
    vals = [getattr(r, metric) for r in results if r.ok and getattr(r, metric) is not None]
    return statistics.median(vals) if vals else None


def _bootstrap_ratio(a: list[float], b: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of median(b)/median(a), resampling prompts."""
    import random

    rng = random.Random(seed)
    idx = range(len(a))
    ratios = []
    for _ in range(n):
        pick = [rng.choice(idx) for _ in idx]
        ratios.append(statistics.median(b[i] for i in pick) / statistics.median(a[i] for i in pick))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


async def _interleaved(urls: dict[str, str], prompts: list[str], a) -> dict[str, list]:
    import httpx

    out: dict[str, list] = {k: [] for k in LABELS}
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.request_timeout, connect=10)) as client:
        for i, prompt in enumerate(prompts):
            got = {}
            for label in LABELS if i % 2 == 0 else LABELS[::-1]:
                got[label] = await one_request(client, urls[label], None, prompt, a.output_len, new_trace_id())
            if i < a.warmup:
                continue
            for label in LABELS:
                out[label].append(got[label])
            done = i + 1 - a.warmup
            if done % 20 == 0 or done == a.requests:
                print(f"  {done}/{a.requests} prompts ({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)
    return out


def _together(a, model: Path, home: Path, prompts: list[str]) -> int:
    stacks: list[Stack] = []
    try:
        urls = {}
        for label in LABELS if a.start_first == "stock" else LABELS[::-1]:
            print(f"starting the {label} {a.mode} pair ...", file=sys.stderr, flush=True)
            stack = Stack(
                mode=a.mode,
                stock=(label == "stock"),
                model=model,
                port=None,
                kvlens_home=home,
                quiet=True,
                vllm_args=["--no-enable-prefix-caching"],
            )
            stacks.append(stack)
            # the second pair starts next to a live one, whose idle workers spin two cores: give it time
            urls[label] = stack.start(timeout=900).router_url
        res = asyncio.run(_interleaved(urls, prompts, a))
    except KeyboardInterrupt:
        print("interrupted; stopping both pairs", file=sys.stderr)
        return 130
    finally:
        for stack in stacks:
            with signals_ignored():
                stack.stop()
    failed = {k: sum(not r.ok for r in v) for k, v in res.items()}
    print(
        f"\nmode={a.mode} input={a.input_len} output={a.output_len} prompts={a.requests} (both pairs alive, "
        f"{a.start_first} started first, alternating order) failed={failed}"
    )
    for m in METRICS:
        both = [
            (getattr(s_, m), getattr(i_, m))
            for s_, i_ in zip(res["stock"], res["instrumented"])
            if s_.ok and i_.ok and getattr(s_, m) and getattr(i_, m)
        ]
        if len(both) < 3:
            print(f"{m:9s} too few prompts answered by both pairs ({len(both)})")
            continue
        st_, in_ = [x for x, _ in both], [y for _, y in both]
        ms, mi = statistics.median(st_), statistics.median(in_)
        lo, hi = _bootstrap_ratio(st_, in_)
        per = statistics.median(y / x for x, y in both)
        print(
            f"{m:9s} n={len(both)}  stock={ms * 1e3:8.2f}ms  instrumented={mi * 1e3:8.2f}ms  "
            f"ratio={mi / ms:.3f} (95% CI {lo:.3f}-{hi:.3f})  median per-prompt ratio={per:.3f}"
        )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="push", choices=["push", "pull"])
    ap.add_argument("--rounds", type=int, default=4, help="start-ups of each pair (default 4)")
    ap.add_argument(
        "--requests",
        type=int,
        default=40,
        help="measured requests per pair per round (default 40); with --together: prompts, each sent to both pairs",
    )
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured requests first (default 4)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument(
        "--together",
        action="store_true",
        help="both pairs alive at once, each prompt to both in alternating order (see above)",
    )
    ap.add_argument(
        "--start-first",
        choices=LABELS,
        default="stock",
        help="--together: which pair starts first (default stock; run it both ways)",
    )
    a = ap.parse_args()
    if a.rounds < 1 or a.requests < 3 or a.input_len < 1 or a.output_len < 2:
        ap.error("need --rounds >= 1, --requests >= 3, --input-len >= 1, --output-len >= 2")

    home = scratch_dir("kvlens-overhead-")
    from kvlens.model import ensure_model

    model = ensure_model(home / "model")
    maker = PromptMaker(model)
    rng = seeded_rng(a.seed)  # numpy Generator, as kvlens bench uses
    prompts = [maker.make(a.input_len, rng) for _ in range(a.warmup + a.requests)]
    if a.together:
        return _together(a, model, home, prompts)
    res: dict[str, list[list]] = {k: [] for k in LABELS}
    t0 = time.monotonic()
    try:
        for rnd in range(a.rounds):
            order = LABELS if rnd % 2 == 0 else LABELS[::-1]
            for label in order:
                stack = Stack(
                    mode=a.mode,
                    stock=(label == "stock"),
                    model=model,
                    port=None,
                    kvlens_home=home,
                    quiet=True,
                    vllm_args=["--no-enable-prefix-caching"],
                )
                try:
                    stack.start()
                    rs = asyncio.run(_closed_loop(stack.router_url, prompts, a))
                finally:
                    with signals_ignored():
                        stack.stop()
                res[label].append(rs)
                line = "  ".join(f"{m}={(_med(rs, m) or 0) * 1e3:.1f}ms" for m in METRICS)
                print(
                    f"round {rnd} {label:12s} {line} failed={sum(not r.ok for r in rs)} ({time.monotonic() - t0:.0f}s)",
                    flush=True,
                )
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
        print(
            f"{m:9s} stock={pooled['stock'] * 1e3:8.2f}ms  instrumented={pooled['instrumented'] * 1e3:8.2f}ms  "
            f"ratio={pooled['instrumented'] / pooled['stock']:.3f}  per-round ratios "
            f"{', '.join(f'{x:.2f}' for x in per_round)}"
        )
    return 0


if __name__ == "__main__":
    with sigterm_as_interrupt():  # SIGTERM unwinds like Ctrl-C: the pair is stopped
        sys.exit(main())
