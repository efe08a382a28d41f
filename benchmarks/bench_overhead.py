"""Serving overhead of the instrumented connector vs vLLM's own, same
workload, side by side in one run (alternating stacks to spread the noise):

    .venv/bin/python benchmarks/bench_overhead.py [--mode push] [--rounds 2]

Prints TTFT / TPOT per stack and the instrumented/stock ratios of the
medians. Nothing is asserted: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
from pathlib import Path

from kvlens import bench
from kvlens.up import Stack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", default="push", choices=["push", "pull"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--qps", type=float, default=2.0)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=24)
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="kvlens-overhead-"))
    from kvlens.model import ensure_model

    model = ensure_model(home / "model")
    results: dict[str, list[dict]] = {"stock": [], "instrumented": []}
    for rnd in range(a.rounds):
        for label in ("stock", "instrumented"):
            opts = bench.BenchOptions(qps=(a.qps,), input_lens=(a.input_len,), output_len=a.output_len,
                                      num_prompts=a.num_prompts, seed=rnd, store=home / "traces.db",
                                      trace_wait_s=2.0 if label == "stock" else 30.0, progress=False, model=model)
            factory = functools.partial(Stack, stock=(label == "stock"), quiet=True)
            run = bench.bench_stacks([a.mode], ["overlapped"], opts, stack_factory=factory)
            results[label].extend(run.rows)
            r = run.rows[-1]
            print(f"round {rnd} {label:12s} ttft_p50={r['ttft_p50_s']*1e3:.1f}ms ttft_mean={r['ttft_mean_s']*1e3:.1f}ms "
                  f"tpot_mean={(r['tpot_mean_s'] or 0)*1e3:.2f}ms completed={r['completed']}", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v if r.get(m)) for m in ("ttft_p50_s", "ttft_mean_s", "tpot_mean_s")}
           for k, v in results.items()}
    for m in ("ttft_p50_s", "ttft_mean_s", "tpot_mean_s"):
        s, i = med["stock"][m], med["instrumented"][m]
        print(f"{m:12s} stock={s*1e3:8.2f}ms instrumented={i*1e3:8.2f}ms ratio={i/s:.3f}")


if __name__ == "__main__":
    main()
