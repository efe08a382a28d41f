"""How much the TTFT of one cell varies between fresh starts of the same stack,
with NIXL's spinning UCX progress threads left as they are (``as-is``), at
SCHED_IDLE only while the stack starts (``startup``) and while it serves too
(``idle``) (:mod:`kvlens.stack.spinners`), interleaved.

    .venv/bin/python benchmarks/bench_spread.py                    # 5 starts per setting, push, 3 settings
    .venv/bin/python benchmarks/bench_spread.py --starts 3 --settings as-is,idle --cells 2048,256
    .venv/bin/python benchmarks/bench_spread.py --stock-vs-instrumented   # the observer effect, by latency
    .venv/bin/python benchmarks/bench_spread.py --stock-vs-instrumented --bare   # ... and where it comes from

For each start (settings alternate ABBA: A B C, C B A, ...) it
starts a fresh instrumented 1P1D stack (:class:`kvlens.stack.launch.Stack`, its own
home), sends each cell (``--requests`` prompts of the cell's token count,
Poisson arrivals at ``--qps``, ``--output-len`` tokens, the same prompts and
arrivals every start) through kvlens' router and reads the client-seen TTFT
p50. During each cell it reads the CPU time of every process of the stack
(P, D, router and their children) and of the whole machine (``/proc/stat``),
so a row says how much CPU came from outside the stack.

Prints one row per (start, cell) and, per (setting, cell), the spread
(max / min of the TTFT p50 over starts) and the median. ``--bare`` adds a
third stack to the stock-vs-instrumented rotation: kvlens' connector with
its store and its metrics off (``kvlens_store: off``, ``kvlens_metrics:
off``: the hooks record, nothing is written or observed), so the
instrumented / stock ratio splits into bare / stock (the hooks) and
instrumented / bare (writing spans and metrics). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlens.bench.prompts import PromptMaker, rng  # noqa: E402
from kvlens.bench.load import run_cell_async  # noqa: E402
from kvlens.bench.results import Target  # noqa: E402
from scratch import scratch_dir  # noqa: E402 (benchmarks/: the script's own directory)
from kvlens.signals import sigterm_as_interrupt  # noqa: E402
from kvlens.bench.machine import MachineWatch  # noqa: E402
from kvlens.stack.launch import Stack  # noqa: E402


def run_cell(stack: Stack, prompts: list[str], a, seed_key: int) -> dict:
    target = Target(stack.mode, stack.dispatch if stack.mode == "push" else None, stack.router_url)
    watch = MachineWatch(stack).start()
    results, _ = asyncio.run(
        run_cell_async(target, None, prompts, a.qps, a.output_len, rng(a.seed, seed_key), timeout_s=a.request_timeout)
    )
    m = watch.stop()  # the CPU of the stack's processes and of the rest of the machine (kvlens.bench.machine)
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    return {
        "ok": len(ttfts),
        "sent": len(results),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttfts_s": ttfts,
        "cpu_share": m["cpu_stack"],
        "outside_share": m["cpu_outside"],
        "placement": m["placement"],
    }


#: ``--bare``: kvlens' connector recording, its store and metrics off.
BARE = {"kvlens_store": "off", "kvlens_metrics": "off"}


def one_start(setting: str, i: int, a, model: Path, prompts: dict[int, list[str]]) -> list[dict]:
    """One fresh stack of ``setting`` (a ``--nixl-progress`` value, or with
    ``--stock-vs-instrumented`` ``stock`` / ``instrumented``), every cell sent once."""
    home = scratch_dir(f"kvlens-spread-{setting}-{i}-")
    rows = []
    stock = setting == "stock" if a.stock_vs_instrumented else a.stock
    progress = a.nixl_progress if a.stock_vs_instrumented else setting
    options = BARE if setting == "bare" else None
    with Stack(
        mode=a.mode,
        model=model,
        port=0,
        kvlens_home=home,
        quiet=True,
        nixl_progress=progress,
        stock=stock,
        connector_options=options,
    ) as st:
        for n, (tokens, ps) in enumerate(prompts.items()):
            r = run_cell(st, ps, a, n)
            rows.append(
                {
                    "setting": setting,
                    "start": i,
                    "input_len": tokens,
                    "startup_s": st.startup_s,
                    **r,
                    "demoted": sum(len(d) for d in (st.progress.demoted if st.progress else {}).values()),
                }
            )
            p50 = r["ttft_p50_s"]
            print(
                f"start {i} {setting:5} {tokens:5} tok: TTFT p50 {p50 * 1e3 if p50 else float('nan'):8.0f} ms "
                f"({r['ok']}/{r['sent']} ok), CPU P {r['cpu_share'].get('prefill', 0):.0%} "
                f"D {r['cpu_share'].get('decode', 0):.0%} router {r['cpu_share'].get('router', 0):.0%} "
                f"outside {r['outside_share']:.0%}; started in {st.startup_s:.0f} s, "
                f"{rows[-1]['demoted']} progress threads demoted"
                f"{' (restored for serving)' if st.progress and st.progress.restored else ''}",
                flush=True,
            )
    return rows


def report(rows: list[dict]) -> None:
    print("\nTTFT p50 over fresh starts (spread = max / min):")
    keys = sorted({(r["setting"], r["input_len"]) for r in rows})
    for setting, tokens in keys:
        v = [r["ttft_p50_s"] for r in rows if (r["setting"], r["input_len"]) == (setting, tokens)]
        got = [x for x in v if x is not None]
        if len(got) < 2 or min(got) <= 0:
            print(f"  {setting:5} {tokens:5} tok: not enough starts with a TTFT ({len(got)} of {len(v)})")
            continue
        print(
            f"  {setting:5} {tokens:5} tok: spread {max(got) / min(got):5.2f}x over {len(got)} starts, "
            f"median {statistics.median(got) * 1e3:7.0f} ms, min {min(got) * 1e3:7.0f}, max {max(got) * 1e3:7.0f}"
            + (f" ({len(v) - len(got)} starts without a TTFT)" if len(got) < len(v) else "")
        )


def report_ratio(rows: list[dict], num: str = "instrumented", den: str = "stock") -> None:
    """Per cell: ``num`` / ``den`` TTFT p50 over all their starts, with a
    hierarchical bootstrap 95 % interval (starts, then requests within a
    start: :func:`kvtrace.stats.bootstrap_ratio`)."""
    from kvtrace.stats import bootstrap_ratio, percentile

    print(f"\n{num} / {den} TTFT p50 (95% bootstrap interval over starts and requests):")
    for tokens in sorted({r["input_len"] for r in rows}):
        side = {v: [r["ttfts_s"] for r in rows if (r["setting"], r["input_len"]) == (v, tokens)] for v in (num, den)}
        p50 = {v: percentile([x for start in side[v] for x in start], 50) for v in side}
        ci = bootstrap_ratio(side[num], side[den])
        if not p50[num] or not p50[den] or ci is None:
            print(f"  {tokens:5} tok: not enough data")
            continue
        inside = ci[0] <= 1.0 <= ci[1]
        print(
            f"  {tokens:5} tok: {p50[num] / p50[den]:.3f} [{ci[0]:.3f}-{ci[1]:.3f}] over "
            f"{len(side[num])}+{len(side[den])} starts: "
            + ("no resolvable difference" if inside else f"{num if ci[1] < 1 else den} lower")
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=5, help="fresh stack starts per setting (default 5)")
    ap.add_argument(
        "--settings",
        default="as-is,startup,idle",
        help="--nixl-progress values to compare (default as-is,startup,idle)",
    )
    ap.add_argument("--mode", choices=["push", "pull"], default="push")
    ap.add_argument("--stock", action="store_true", help="vLLM's own connectors instead of kvlens'")
    ap.add_argument(
        "--stock-vs-instrumented",
        action="store_true",
        help="compare vLLM's own connectors with kvlens' instead of --settings (both with "
        "--nixl-progress), and print the instrumented / stock TTFT ratio with its interval",
    )
    ap.add_argument("--nixl-progress", default="auto", help="with --stock-vs-instrumented: both stacks' setting")
    ap.add_argument(
        "--bare",
        action="store_true",
        help="with --stock-vs-instrumented: a third stack, kvlens' connector with its store and metrics off",
    )
    ap.add_argument("--cells", default="2048,256", help="prompt lengths in tokens, one cell each (default 2048,256)")
    ap.add_argument("--qps", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    settings = ["instrumented", "stock"] if a.stock_vs_instrumented else [s for s in a.settings.split(",") if s]
    if a.bare and not a.stock_vs_instrumented:
        ap.error("--bare goes with --stock-vs-instrumented")
    if a.bare:
        settings.append("bare")
    if (
        a.starts < 1
        or not settings
        or (not a.stock_vs_instrumented and set(settings) - {"as-is", "startup", "idle", "auto"})
    ):
        ap.error("--starts >= 1; --settings: as-is, startup, idle and/or auto")
    from kvlens.model import ensure_model

    model = ensure_model(scratch_dir("kvlens-spread-model-") / "model")
    maker = PromptMaker(model)
    prompts = {
        int(t): [maker.make(int(t), rng(a.seed, int(t), j)) for j in range(a.requests)] for t in a.cells.split(",")
    }
    order = []  # ABBA: A B C, C B A, A B C, ...
    for i in range(a.starts):
        order += [(s, i) for s in (settings if i % 2 == 0 else settings[::-1])]
    rows: list[dict] = []
    try:
        for setting, i in order:
            rows += one_start(setting, i, a, model, prompts)
    except KeyboardInterrupt:
        print("interrupted; the stack was stopped", file=sys.stderr)
    report(rows)
    if a.stock_vs_instrumented:
        report_ratio(rows)
    if a.bare:
        report_ratio(rows, "bare", "stock")
        report_ratio(rows, "instrumented", "bare")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    with sigterm_as_interrupt():
        sys.exit(main())
