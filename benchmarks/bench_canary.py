"""The what-if validated on a canary (issue 31, item 4): one push pair and
one pull pair behind one kvlens router (``kvlens up --mode push,pull``),
each request's mode drawn at push=0.5, over a grid of prompt lengths and
loads. In each cell, from each half's traces the what-if of the other half
(:func:`kvtrace.whatif.predict`), against what the other half measured in
the same cell, at the same time, on the same machine:

    .venv/bin/python benchmarks/bench_canary.py [--tokens 256,2048] [--qps 1,4] [--requests 40] [--out FILE]

Per cell and direction it prints the predicted p50 handoff and TTFT with
their 95 % intervals, the measured p50s, the error ((predicted - measured) /
measured) and whether the measured value lies in the interval; then the
targets of the issue: the measured handoff inside the interval in at least
3 of 4 cells (counted per direction) and the median absolute error of the
handoff p50 at most 25 %. Nothing is asserted: the figures are what they
are; docs/verdict.md keeps a measured table.

Everything runs in a scratch directory (its own home, store and logs),
removed at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from scratch import scratch_dir  # noqa: E402 (benchmarks/: the script's own directory)
from whatif_check import HEADER, check_cell, coverage_lines, line, ms, phase_medians, settled

from kvlens.bench.load import run_cell_async
from kvlens.bench.prompts import PromptMaker
from kvlens.bench.prompts import rng as seeded_rng
from kvlens.bench.results import Target
from kvlens.signals import sigterm_as_interrupt
from kvlens.stack.launch import Stack
from kvlens.stack.supervise import signals_ignored


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=_ints, default=[256, 2048], help="prompt lengths (default 256,2048)")
    ap.add_argument("--qps", type=_floats, default=[1.0, 4.0], help="Poisson arrival rates (default 1,4)")
    ap.add_argument("--requests", type=int, default=40, help="requests per cell, both modes (default 40)")
    ap.add_argument("--output-len", type=int, default=16, help="output tokens per request (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: the generated tiny model)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        help="keep the stack's logs here (default: the scratch dir, removed at exit)",
    )
    a = ap.parse_args(argv)

    home = scratch_dir("kvlens-bench-canary-")
    stack = Stack(
        mode="push,pull", model=a.model, port=0, kvlens_home=home, log_dir=a.keep_logs or home / "logs", quiet=True
    )
    rows: list[dict] = []
    phases: list[dict] = []
    with sigterm_as_interrupt():
        try:
            t0 = time.monotonic()
            stack.start()
            print(f"mixed fleet up in {time.monotonic() - t0:.0f}s: {stack.router_url}", flush=True)
            maker = PromptMaker(stack.model)
            target = Target("push,pull", "overlapped", stack.router_url)
            for i, tokens in enumerate(a.tokens):
                for j, qps in enumerate(a.qps):
                    cell = f"{tokens} tok, {qps:g} QPS"
                    r = seeded_rng(a.seed, i, j)
                    prompts = [maker.make(tokens, r) for _ in range(a.requests)]
                    results, took = asyncio.run(run_cell_async(target, None, prompts, qps, a.output_len, r))
                    ok = [x for x in results if x.ok]
                    tids = [x.trace for x in ok]
                    got = settled(stack.store, tids)
                    traces = list(got.values())
                    print(
                        f"{cell}: {len(ok)}/{len(results)} ok in {took:.0f}s; "
                        f"push {sum(t.mode == 'push' for t in traces)}, pull {sum(t.mode == 'pull' for t in traces)}",
                        flush=True,
                    )
                    for mode in ("push", "pull"):
                        med = phase_medians([t for t in traces if t.mode == mode])
                        print(
                            f"  {mode} handoff, median tiled share: "
                            + ", ".join(f"{n} {ms(v)}" for n, v in med.items())
                        )
                        phases.append({"cell": cell, "mode": mode, "median_share_s": med})
                    for r in check_cell(cell, traces):
                        rows.append(r)
                        print(line(r), flush=True)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        finally:
            with signals_ignored():
                stack.stop()
    print("\n" + HEADER)
    for r in rows:
        print(line(r))
    for text in coverage_lines(rows):
        print(text)
    if a.out:
        a.out.write_text(json.dumps({"rows": rows, "phases": phases}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
