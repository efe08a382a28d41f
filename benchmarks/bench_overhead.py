"""Serving overhead of the instrumented connector vs vLLM's own, same
workload, side by side in one run:

    .venv/bin/python benchmarks/bench_overhead.py [--mode push] [--pairs 60]

Both P/D pairs (stock and instrumented) are alive at once and get the same
prompts one request at a time, interleaved A B, B A, A B, ... so both see
the same machine at the same moment. An earlier design (one pair at a time,
restarted every round) measured the difference between two vLLM start-ups
more than the connector: round-to-round TTFT medians moved 4x either way on
this 2-core box, where every idle vLLM worker spins a core in NIXL's
progress thread.

Prints the medians per connector, the ratio of medians with a bootstrap 95 %
interval over the pairs, and the median of the per-pair ratios. Nothing is
asserted: a shared machine is noisy, and the interval says how noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvlens import bench
from kvlens.up import Stack

LABELS = ("stock", "instrumented")


def _bootstrap_ratio(a: list[float], b: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of median(b)/median(a), resampling pairs."""
    rng = random.Random(seed)
    idx = range(len(a))
    ratios = []
    for _ in range(n):
        s = [rng.choice(idx) for _ in idx]
        ratios.append(statistics.median(b[i] for i in s) / statistics.median(a[i] for i in s))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


async def _run_pairs(urls: dict[str, str], maker: bench.PromptMaker, a) -> dict[str, list]:
    import httpx

    rng = random.Random(a.seed)
    out: dict[str, list] = {k: [] for k in LABELS}
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.request_timeout, connect=10)) as client:
        for i in range(a.warmup + a.pairs):
            prompt = maker.make(a.input_len, rng)
            order = LABELS if i % 2 == 0 else LABELS[::-1]
            got = {}
            for label in order:
                got[label] = await bench.one_request(client, urls[label], None, prompt, a.output_len, bench.new_request_id())
            if i < a.warmup:
                continue
            for label in LABELS:
                out[label].append(got[label])
            done = i + 1 - a.warmup
            if done % 10 == 0 or done == a.pairs:
                print(f"  {done}/{a.pairs} pairs ({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)
    return out


def _report(res: dict[str, list], metric: str) -> None:
    pairs = [(s, i) for s, i in zip(res["stock"], res["instrumented"])
             if s.ok and i.ok and getattr(s, metric) is not None and getattr(i, metric) is not None]
    if len(pairs) < 3:
        print(f"{metric}: too few successful pairs ({len(pairs)})")
        return
    st = [getattr(s, metric) for s, _ in pairs]
    ins = [getattr(i, metric) for _, i in pairs]
    ms, mi = statistics.median(st), statistics.median(ins)
    lo, hi = _bootstrap_ratio(st, ins)
    per_pair = statistics.median(i / s for s, i in zip(st, ins) if s > 0)
    print(f"{metric:7s} n={len(pairs):3d}  stock median={ms * 1e3:8.2f} ms  instrumented median={mi * 1e3:8.2f} ms  "
          f"ratio of medians={mi / ms:.3f} (95% CI {lo:.3f}-{hi:.3f})  median per-pair ratio={per_pair:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="push", choices=["push", "pull"])
    ap.add_argument("--pairs", type=int, default=60, help="measured request pairs (default 60)")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured pairs first (default 4)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    a = ap.parse_args()
    if a.pairs < 3 or a.input_len < 1 or a.output_len < 2:
        ap.error("need --pairs >= 3, --input-len >= 1, --output-len >= 2")
    signal.signal(signal.SIGTERM, bench._on_term)  # unwind: stop both pairs

    home = Path(tempfile.mkdtemp(prefix="kvlens-overhead-"))
    from kvlens.model import ensure_model

    model = ensure_model(home / "model")
    stacks: dict[str, Stack] = {}
    try:
        for label in LABELS:
            print(f"starting {label} {a.mode} pair ...", file=sys.stderr, flush=True)
            stacks[label] = Stack(mode=a.mode, stock=(label == "stock"), model=model, port=None,
                                  kvlens_home=home, quiet=True,
                                  vllm_args=["--no-enable-prefix-caching"]).start(timeout=1200)
        maker = bench.PromptMaker(model)
        urls = {k: s.router_url for k, s in stacks.items()}
        res = asyncio.run(_run_pairs(urls, maker, a))
    except KeyboardInterrupt:
        print("interrupted; stopping both pairs", file=sys.stderr)
        return 130
    finally:
        for s in stacks.values():
            bench._stop_quietly(s)
    failed = {k: sum(not r.ok for r in v) for k, v in res.items()}
    print(f"mode={a.mode} input={a.input_len} output={a.output_len} pairs={a.pairs} failed={failed}")
    for metric in ("ttft_s", "tpot_s", "latency_s"):
        _report(res, metric)
    return 0


if __name__ == "__main__":
    sys.exit(main())
