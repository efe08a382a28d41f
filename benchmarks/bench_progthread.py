"""With and without NIXL's UCX progress thread (issue 41 item 9): one mixed
``--hosts`` fleet (as ``bench_links.py``: a push pair, overlapped, and a pull
pair behind one kvlens router, the same one-way delay on P<->D and
router<->D) started with ``--nixl-progress`` as given (``auto``: the thread,
SCHED_IDLE as kvlens up gives it on this host; ``off``: every worker's NIXL
agent created without it, :mod:`instrumented_connector.nixlagent`), and at
each delay the bench grid plus an output check: the same fixed prompts
(temperature 0, 16 tokens) sent to each half, their completions kept, so
that runs with and without the thread can be compared word for word.

    .venv/bin/python benchmarks/bench_progthread.py --nixl-progress off --delays 0,5 --requests 12 --out off1.json
    .venv/bin/python benchmarks/bench_progthread.py --nixl-progress auto --delays 0,5 --requests 12 --out on1.json
    .venv/bin/python benchmarks/bench_progthread.py --table on1.json off1.json [...]   # the tables, merged

Root only (network namespaces). Per mode and cell: the handoff p50 with a
bootstrap 95 % interval over the requests, the median CPU-wait share of the
handoff (``handoff_cpu_wait_s / handoff_s``, kvtrace.cpusplit), the
push/pull verdict (bench_links' "says"), and the workers' busiest non-main
thread's share of a CPU with the engines idle (the spinning progress thread
where there is one). Nothing is asserted; docs/links.md keeps the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path


import numpy as np
from bench_links import floats_arg, ints_arg, ratio_text, reshaped_run, says, specs_for  # noqa: E402 (benchmarks/)
from scratch import scratch_dir  # noqa: E402
from whatif_check import phase_medians, settled

from kvlens.bench.grid import BenchOptions
from kvlens.bench.prompts import PromptMaker, rng
from kvlens.signals import sigterm_as_interrupt
from kvlens.stack import spinners
from kvlens.stack.commands import auth_headers
from kvlens.stack.launch import Stack
from kvlens.stack.supervise import signals_ignored
from kvtrace import cpusplit

#: the output check: prompts per mode, their length and output tokens
CHECK_PROMPTS, CHECK_TOKENS, CHECK_OUTPUT = 6, 256, 16


def p50_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float | None, float, float]:
    """The median and its bootstrap 95 % interval (percentile method)."""
    if not values:
        return None, float("nan"), float("nan")
    a = np.asarray(values, dtype=float)
    gen = np.random.default_rng(seed)
    meds = np.median(gen.choice(a, size=(resamples, len(a)), replace=True), axis=1)
    return float(np.median(a)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def spin_shares(stack: Stack) -> dict[str, float]:
    """Each server's workers' busiest non-main thread, share of one CPU (engines idle)."""
    out = {}
    for c in stack.children:
        if c.proc is None or not c.name.startswith(("prefill", "decode")):
            continue
        try:
            for _pid, (_tid, share) in spinners.busiest_threads(spinners.worker_pids(c.proc.pid), 1.0).items():
                out[c.name] = max(out.get(c.name, 0.0), round(share, 3))
        except Exception as e:  # noqa: BLE001 - a figure, not the run
            print(f"  {c.name}: no thread sample ({e})", file=sys.stderr)
    return out


def output_check(stack: Stack, maker: PromptMaker, seed: int) -> dict[str, list[str | None]]:
    """The completions of the same fixed prompts, per mode (None: the request failed)."""
    import httpx

    prompts = [maker.make(CHECK_TOKENS, rng(seed, 7777, i)) for i in range(CHECK_PROMPTS)]
    out: dict[str, list[str | None]] = {}
    with httpx.Client(timeout=120.0) as client:
        try:  # the served model's name, as the bench's requests give it
            model = client.get(stack.router_url + "/v1/models", headers=auth_headers(stack.api_key)).json()["data"][0][
                "id"
            ]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            model = str(stack.model)
        for mode in ("push", "pull"):
            texts: list[str | None] = []
            for i, p in enumerate(prompts):
                body = {"prompt": p, "max_tokens": CHECK_OUTPUT, "min_tokens": CHECK_OUTPUT, "ignore_eos": True,
                        "temperature": 0.0, "model": model}  # fmt: skip
                try:
                    r = client.post(
                        stack.router_url + "/v1/completions",
                        json=body,
                        headers={
                            "X-Kvlens-Mode": mode,
                            "X-Request-Id": f"check-{mode}-{i}-{time.time_ns()}",
                            **auth_headers(stack.api_key),
                        },  # fmt: skip
                    )
                    texts.append(r.json()["choices"][0]["text"] if r.status_code == 200 else None)
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    texts.append(None)
            out[mode] = texts
    return out


def cell_figures(traces: list) -> dict:
    """One mode's requests of one cell: handoff p50 [95 %], CPU-wait share p50, tiled phases."""
    hs, shares = [], []
    for t in traces:
        if t.handoff_s is None:
            continue
        hs.append(t.handoff_s)
        split = cpusplit.handoff_cpu(t)
        if split.cpu_wait_s is not None and split.handoff_s:
            shares.append(split.cpu_wait_s / split.handoff_s)
    p50, lo, hi = p50_interval(hs)
    return {"n": len(hs), "handoff_p50_s": p50, "handoff_p50_lo_s": lo, "handoff_p50_hi_s": hi,
            "cpu_wait_share_p50": statistics.median(shares) if shares else None, "cpu_n": len(shares),
            "phases": phase_medians(traces)}  # fmt: skip


def run_one(stack: Stack, delay_ms: float, opts: BenchOptions, maker: PromptMaker, seed: int) -> dict:
    """Re-shape to ``delay_ms``, probe, run the grid, then the output check."""
    t0 = time.monotonic()
    targets, run = reshaped_run(stack, delay_ms, opts)
    cells = []
    for push in (r for r in run.rows if r["mode"] == "push"):
        tokens, qps = push["input_len"], push["qps"]
        cell: dict = {"delay_ms": delay_ms, "tokens": tokens, "qps": qps, "says": says(push, "handoff_p50_s"),
                      "ratio": ratio_text(push, "handoff_p50_s"), "ttft_says": says(push, "ttft_p50_s"),
                      "ttft_ratio": ratio_text(push, "ttft_p50_s")}  # fmt: skip
        mine = [c for c in run.cells if c.input_len == tokens and c.qps == qps]
        traces = settled(stack.store, [r.trace for c in mine for r in c.results if r.ok], timeout_s=60.0)
        for mode in ("push", "pull"):
            row = next((r for r in run.rows if r["mode"] == mode and r["input_len"] == tokens and r["qps"] == qps), {})
            cell[mode] = {**cell_figures([t for t in traces.values() if t.mode == mode]),
                          "completed": row.get("completed"), "failed": row.get("failed"),
                          "row_cpu_wait_share_p50": row.get("handoff_cpu_wait_share_p50"),
                          "ttft_p50_s": row.get("ttft_p50_s")}  # fmt: skip
        cells.append(cell)
        print(f"  {line(cell)}", flush=True)
    outputs = output_check(stack, maker, seed)
    print(f"=== delay {delay_ms:g} ms done in {time.monotonic() - t0:.0f}s", flush=True)
    return {"delay_ms": delay_ms, "link": targets[0].link, "cells": cells, "outputs": outputs}


def _ms(v) -> str:
    return "-" if v is None or v != v else f"{v * 1e3:.1f}"


def line(cell: dict) -> str:
    parts = [f"{cell['delay_ms']:g} ms, {cell['tokens']} tok, {cell['qps']:g} QPS"]
    for mode in ("push", "pull"):
        m = cell.get(mode) or {}
        share = m.get("cpu_wait_share_p50")
        parts.append(
            f"{_ms(m.get('handoff_p50_s'))} [{_ms(m.get('handoff_p50_lo_s'))}-{_ms(m.get('handoff_p50_hi_s'))}]"
            f" | {'-' if share is None else f'{share * 100:.0f} %'} | {m.get('completed', '-')}/{m.get('n', '-')}"
        )
    parts.append(f"{cell['ratio']} {cell['says']}")
    return "| " + " | ".join(parts) + " |"


HEADER = (
    "| run | cell | push handoff p50, ms [95 %] | push CPU wait | push n | pull handoff p50, ms [95 %] "
    "| pull CPU wait | pull n | push/pull [95 %] says |\n|---|---|---|---|---|---|---|---|---|"
)


def print_tables(runs: list[dict]) -> None:
    print("\n" + HEADER)
    for r in runs:
        for d in r["delays"]:
            for c in d["cells"]:
                print(f"| {r['label']} |{line(c)[1:]}")
    print("\n| run | idle worker threads' busiest non-main share of a CPU |\n|---|---|")
    for r in runs:
        print(f"| {r['label']} | {r.get('spin')} |")
    print("\noutput check (same prompts, temperature 0), against the first run:")
    ref = {d["delay_ms"]: d["outputs"] for d in runs[0]["delays"]}
    for r in runs:
        for d in r["delays"]:
            for mode, texts in d["outputs"].items():
                base = (ref.get(d["delay_ms"]) or runs[0]["delays"][0]["outputs"])[mode]
                same = sum(1 for a, b in zip(texts, base) if a is not None and a == b)
                fails = sum(1 for a in texts if a is None)
                print(f"  {r['label']}, {d['delay_ms']:g} ms, {mode}: {same}/{len(texts)} identical, {fails} failed")
            push, pull = d["outputs"].get("push", []), d["outputs"].get("pull", [])
            both = sum(1 for a, b in zip(push, pull) if a is not None and a == b)
            print(f"  {r['label']}, {d['delay_ms']:g} ms: push and pull gave the same text for {both}/{len(push)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nixl-progress", choices=spinners.MODES, default="auto")
    ap.add_argument("--delays", type=floats_arg, default=[0, 5])
    ap.add_argument("--tokens", type=ints_arg, default=[256])
    ap.add_argument("--qps", type=floats_arg, default=[1.0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default=None, help="the run's name in the tables (default: the mode)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", type=Path, nargs="+", default=None, help="only print the tables of these --out files")
    a = ap.parse_args(argv)
    if a.table:
        print_tables([json.loads(f.read_text()) for f in a.table])
        return 0
    home = scratch_dir("kvlens-bench-progthread-")
    stack = Stack(mode="push,pull", port=0, kvlens_home=home, log_dir=home / "logs", quiet=True, hosts=True,
                  links=specs_for(a.delays[0]), vllm_args=["--no-enable-prefix-caching"],
                  nixl_progress=a.nixl_progress)  # fmt: skip
    out: dict = {"label": a.label or a.nixl_progress, "nixl_progress": a.nixl_progress, "delays": []}
    with sigterm_as_interrupt():
        try:
            t0 = time.monotonic()
            stack.start()
            out["startup_s"] = round(time.monotonic() - t0, 1)
            out["spin"] = spin_shares(stack)
            out["progress"] = stack.progress.to_json() if stack.progress else None
            print(f"fleet up in {out['startup_s']:.0f}s ({a.nixl_progress}); busiest worker threads: {out['spin']}")
            opts = BenchOptions(qps=a.qps, input_lens=a.tokens, output_len=16, num_prompts=a.requests, seed=a.seed,
                                store=str(stack.store.path), model=stack.model, trace_wait_s=60.0)  # fmt: skip
            maker = PromptMaker(stack.model)
            for d in a.delays:
                out["delays"].append(run_one(stack, d, opts, maker, a.seed))
                if a.out:
                    a.out.write_text(json.dumps(out, indent=1) + "\n")
        except KeyboardInterrupt:
            print("interrupted; keeping the delays that finished", file=sys.stderr)
        finally:
            with signals_ignored():
                stack.stop()
            if a.out:  # the servers' logs beside the figures (the scratch directory goes at exit)
                shutil.copytree(home / "logs", a.out.with_suffix(".logs"), dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("prometheus-*"))  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    if out["delays"]:
        print_tables([out])
    return 0 if len(out["delays"]) == len(a.delays) else 130


if __name__ == "__main__":
    sys.exit(main())
