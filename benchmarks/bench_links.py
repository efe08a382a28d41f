"""Push vs pull as the link delay grows (issue 36, item 3): one mixed fleet
(``kvlens up --mode push,pull --hosts``: a push pair, overlapped, and a pull
pair behind one kvlens router, every role in its own network namespace),
the same one-way delay on P<->D and router<->D, re-shaped between delays on
the running stack (no restart), and at each delay the bench grid (prompt
lengths x QPS; per cell the pull half, then the push half, each request
naming its half with ``X-Kvlens-Mode``) with bootstrap 95 % intervals on
each push/pull ratio (:func:`kvlens.bench.runner.bench_routers`). Per cell
also the what-if validation: each mode predicted from the other's traces
(:mod:`whatif_check`, shared with ``bench_canary.py``) against what it
measured, and each mode's median tiled phases:

    .venv/bin/python benchmarks/bench_links.py [--delays 0,1,5,20] [--tokens 256,2048] [--qps 1,4] \\
        [--requests 16] [--sched-trace] [--out FILE]
    .venv/bin/python benchmarks/bench_links.py --table FILE [FILE ...]   # the tables of earlier runs, merged

Root only (network namespaces). Delay 0 keeps the delayers in the path with
no delay (the probe's round trip shows what they cost). Each delay's
figures are written to ``--out`` as soon as they are measured, so a run can
be split into chunks (``--delays 0,1`` then ``--delays 5,20``) and merged
with ``--table``. Nothing is asserted: the figures are what they are;
docs/links.md keeps a measured table. Everything runs in a scratch directory
(its own home, store and logs), removed at exit; a stack that fails to start
or breaks is said in one line on stderr, exit 1, its logs kept in a folder
named there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from scratch import scratch_dir  # noqa: E402 (benchmarks/: the script's own directory)
from whatif_check import HEADER, check_cell, coverage_lines, line, ms, phase_medians, settled

from kvrecord.argtypes import int_in
from kvlens.bench.grid import BenchOptions
from kvlens.bench.runner import bench_routers, new_run, stack_targets
from kvlens.signals import sigterm_as_interrupt
from kvlens.stack.errors import StackError
from kvlens.stack.launch import Stack
from kvlens.stack.supervise import signals_ignored
from kvtrace import benchrows, schedtrace

#: The links the delay goes on (both directions of each).
LINKS = ("p-d", "router-d")


def floats_arg(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def ints_arg(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def specs_for(delay_ms: float) -> list[str]:
    return [f"{link}={delay_ms:g}ms" for link in LINKS]


def pair_directions(stack: Stack) -> set[tuple[str, str]]:
    """The directions the requests cross: each P with its own mode's D, and router<->each D
    (a mixed fleet's ``p-d`` also shapes push P to pull D, which carries nothing)."""
    out = set()
    for i in range(stack.decode_instances):
        mode = stack.mode_of("decode", i)
        ps = [j for j in range(stack.prefill_instances) if stack.mode_of("prefill", j) == mode]
        for j in ps:
            out |= {(f"p{j}", f"d{i}"), (f"d{i}", f"p{j}")}
        out |= {("router", f"d{i}"), (f"d{i}", "router")}
    return out


def reshaped_run(stack: Stack, delay_ms: float, opts: BenchOptions):
    """Re-shape the stack's links to ``delay_ms``, probe them and run the grid
    over both modes (overlapped push): (the targets, the bench run)."""
    t0 = time.monotonic()
    specs = specs_for(delay_ms)
    for sp in specs:
        stack.reshape(sp, probe=False)
    stack.probe_links(only=pair_directions(stack))
    o = replace(opts, links=tuple(specs))
    targets = stack_targets(stack, "push,pull", ["overlapped"], o)
    link = targets[0].link
    print(f"\n=== delay {delay_ms:g} ms: {link['summary']} (re-shaped and probed in {time.monotonic() - t0:.0f}s)")
    return targets, bench_routers(targets, o, run=new_run(o))


def run_delay(stack: Stack, delay_ms: float, opts: BenchOptions, sched_dir: Path | None = None) -> dict:
    """Re-shape the links to ``delay_ms``, probe them, run the grid, check the what-if per cell
    (with ``sched_dir``, the CPU split walked through the kernel's record kept there, read after each cell)."""
    t0 = time.monotonic()
    targets, run = reshaped_run(stack, delay_ms, opts)
    link = targets[0].link
    whatif, phases, cells_ids = [], [], []
    for tokens in opts.input_lens:
        for qps in opts.qps:
            cell = f"{delay_ms:g} ms, {tokens} tok, {qps:g} QPS"
            cells = [c for c in run.cells if c.input_len == tokens and c.qps == qps]
            tids = [r.trace for c in cells for r in c.results if r.ok]
            traces = list(settled(stack.store, tids, timeout_s=opts.trace_wait_s).values())
            cells_ids.append({"cell": cell, "input_len": tokens, "qps": qps,
                              **{m: [t.trace_id for t in traces if t.mode == m] for m in ("push", "pull")}})  # fmt: skip
            if sched_dir is not None:  # the live record, while the cell's requests are still in its buffer
                t0_read = time.monotonic()
                starts = [t.start_ns for t in traces if t.start_ns]
                tl = schedtrace.load(sched_dir, since_ns=min(starts) - 10**10 if starts else None)
                covered = sum(1 for t in traces if t.start_ns and t.end_ns and tl.covers(t.start_ns, t.end_ns))
                traces = [replace(t, sched=tl) for t in traces]
                print(f"  {cell}: kernel record read in {time.monotonic() - t0_read:.0f}s, covers {covered} of "
                      f"{len(traces)} requests (lost events {tl.lost}, missed switch-ins {tl.missed}, TCP "
                      f"tracepoints {'on' if tl.net else 'off'})", flush=True)  # fmt: skip
            for mode in ("push", "pull"):
                mine = [t for t in traces if t.mode == mode]
                med = phase_medians(mine)
                phases.append({"cell": cell, "mode": mode, "median_share_s": med, **transfer_medians(mine)})
                print(
                    f"  {cell}: {mode} handoff, median tiled share: "
                    + ", ".join(f"{n} {ms(v)}" for n, v in med.items())
                )
            for r in check_cell(cell, traces):
                whatif.append(r)
                print("  " + line(r), flush=True)
    took = time.monotonic() - t0
    print(f"=== delay {delay_ms:g} ms done in {took:.0f}s", flush=True)
    return {"delay_ms": delay_ms, "link": link, "run_id": run.run_id, "rows": run.rows, "whatif": whatif,
            "phases": phases, "cells": cells_ids, "seconds": took}  # fmt: skip


def transfer_medians(traces: list) -> dict:
    """The median KV bytes per request and kvlens' bandwidth figure (bytes over NIXL's transfer time)."""
    figs = [t.to_json().get("transfer") or {} for t in traces]
    nbytes = [f["bytes"] for f in figs if f.get("bytes")]
    gbps = [f["gbps"] for f in figs if f.get("gbps")]
    return {
        "kv_bytes_p50": statistics.median(nbytes) if nbytes else None,
        "gbps_p50": statistics.median(gbps) if gbps else None,
    }


def ratio_text(row: dict, metric: str) -> str:
    r = row.get(benchrows.ratio_key(metric))
    lo, hi = (row.get(k) for k in benchrows.interval_keys(metric))
    if r is None:
        return "-"
    iv = "[?]" if lo is None or hi is None else f"[{lo:.2f}-{hi:.2f}]"
    return f"{r:.2f} {iv}"


def says(row: dict, metric: str) -> str:
    lo, hi = (row.get(k) for k in benchrows.interval_keys(metric))
    if lo is None or hi is None:
        return "unknown (too few requests)"
    if hi < 1:
        return "push lower"
    if lo > 1:
        return "pull lower"
    return "no resolvable difference"


def _rtt(link: dict, a: str, b: str) -> str:
    rtts = sorted(
        d["rtt_s"] for d in link["directions"]
        if d.get("rtt_s") is not None and {d["src"][:1] if d["src"][1:].isdigit() else d["src"],
                                           d["dst"][:1] if d["dst"][1:].isdigit() else d["dst"]} == {a, b}
    )  # fmt: skip
    return "?" if not rtts else f"{rtts[len(rtts) // 2] * 1e3:.1f}"


GRID_HEADER = (
    "| delay | RTT P-D / R-D, ms | tokens | QPS | handoff p50 pull / push, ms | push/pull [95 %] | says "
    "| TTFT p50 pull / push, ms | push/pull [95 %] | says | n pull / push |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def grid_lines(delays: list[dict]) -> list[str]:
    out = []
    for dl in delays:
        rtt = f"{_rtt(dl['link'], 'p', 'd')} / {_rtt(dl['link'], 'router', 'd')}"
        rows = dl["rows"]
        for push in (r for r in rows if r["mode"] == "push"):
            pull = next(
                (r for r in rows if r["mode"] == "pull" and benchrows.cell_key(r) == benchrows.cell_key(push)), {}
            )
            out.append(
                f"| {dl['delay_ms']:g} ms | {rtt} | {push['input_len']} | {push['qps']:g} "
                f"| {ms(pull.get('handoff_p50_s'))} / {ms(push.get('handoff_p50_s'))} | {ratio_text(push, 'handoff_p50_s')} "
                f"| {says(push, 'handoff_p50_s')} | {ms(pull.get('ttft_p50_s'))} / {ms(push.get('ttft_p50_s'))} "
                f"| {ratio_text(push, 'ttft_p50_s')} | {says(push, 'ttft_p50_s')} "
                f"| {pull.get('completed', '-')} / {push.get('completed', '-')} |"
            )
    return out


def _phase_text(p: dict | None) -> str:
    if not p:
        return "-"
    text = ", ".join(f"{n} {ms(v)}" for n, v in p["median_share_s"].items())
    if p.get("kv_bytes_p50"):
        gbps = p.get("gbps_p50")
        text += f" (KV {p['kv_bytes_p50'] / 1024:.0f} KiB, {'?' if not gbps else f'{gbps * 1e3:.0f}'} Mbit/s)"
    return text


def keep_store(src: Path, dst: Path) -> None:
    """A consistent copy of the live SQLite store ``src`` at ``dst`` (SQLite's online backup)."""
    import sqlite3

    with sqlite3.connect(f"file:{src}?mode=ro", uri=True) as a, sqlite3.connect(dst) as b:
        a.backup(b)
    print(f"trace store kept: {dst}", flush=True)


def print_tables(delays: list[dict]) -> None:
    delays = sorted(delays, key=lambda d: d["delay_ms"])
    print("\n" + GRID_HEADER)
    print("\n".join(grid_lines(delays)))
    print("\n" + HEADER)
    rows = [r for d in delays for r in d["whatif"]]
    print("\n".join(line(r) for r in rows))
    for d in delays:
        for text in coverage_lines(d["whatif"]):
            print(f"{d['delay_ms']:g} ms: {text}")
    for text in coverage_lines(rows, target_cells="3 of 4 per delay"):
        print(f"all delays: {text}")
    print("\n| cell | push: median tiled share, ms | pull |\n|---|---|---|")
    for d in delays:
        by = {(p["cell"], p["mode"]): p for p in d["phases"]}
        for cell in dict.fromkeys(p["cell"] for p in d["phases"]):
            print(f"| {cell} | {_phase_text(by.get((cell, 'push')))} | {_phase_text(by.get((cell, 'pull')))} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delays", type=floats_arg, default=[0, 1, 5, 20], help="one-way delays, ms (default 0,1,5,20)")
    ap.add_argument("--tokens", type=ints_arg, default=[256, 2048], help="prompt lengths (default 256,2048)")
    ap.add_argument("--qps", type=floats_arg, default=[1.0, 4.0], help="Poisson arrival rates per mode (default 1,4)")
    ap.add_argument("--requests", type=int, default=16, help="requests per cell and mode (default 16)")
    ap.add_argument("--output-len", type=int, default=16, help="output tokens per request (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: the generated tiny model)")
    ap.add_argument("--out", type=Path, default=None, help="write each delay's figures here as JSON (as they come)")
    ap.add_argument("--table", type=Path, nargs="+", default=None, help="only print the tables of these --out files")
    ap.add_argument("--sched-trace", action="store_true",
                    help="keep the kernel's scheduler record (as kvlens up --sched-trace) and give the what-if the "
                    "CPU split walked through it: every phase's CPU wait, the transfer's from its TCP tracepoints")  # fmt: skip
    ap.add_argument("--sched-buffer-mb", type=int_in(1, 65536, "a size in MiB"), default=512,
                    help="with --sched-trace: the record's kernel memory, MiB (default 512: a cell's requests must "
                    "still be in it when the cell is read; the mixed fleet fills 128 MiB in about 100 s)")  # fmt: skip
    ap.add_argument("--keep-store", type=Path, default=None,
                    help="copy the stack's trace store (SQLite) here at the end: each cell's requests, named by "
                    "trace id in --out's \"cells\", can then be read again (kvlens traces --store, or the what-if)")  # fmt: skip
    a = ap.parse_args(argv)
    if a.keep_store is not None and a.keep_store.exists():
        ap.error(f"--keep-store {a.keep_store}: exists already (not overwritten)")
    if a.table:
        print_tables([d for f in a.table for d in json.loads(f.read_text())["delays"]])
        return 0
    if any(d < 0 for d in a.delays) or a.requests < 2:
        ap.error("delays must be >= 0 and --requests >= 2")

    home = scratch_dir("kvlens-bench-links-")
    stack = Stack(mode="push,pull", model=a.model, port=0, kvlens_home=home, log_dir=home / "logs", quiet=True,
                  hosts=True, links=specs_for(0), vllm_args=["--no-enable-prefix-caching"])  # fmt: skip
    delays: list[dict] = []
    failed = ""
    with sigterm_as_interrupt():
        try:
            t0 = time.monotonic()
            stack.start()
            print(f"mixed --hosts fleet up in {time.monotonic() - t0:.0f}s: {stack.router_url}", flush=True)
            opts = BenchOptions(qps=a.qps, input_lens=a.tokens, output_len=a.output_len, num_prompts=a.requests,
                                seed=a.seed, store=str(stack.store.path), model=stack.model, trace_wait_s=60.0)  # fmt: skip
            sched_dir = stack.record_sched(buffer_mb=a.sched_buffer_mb).folder if a.sched_trace else None
            for d in a.delays:
                delays.append(run_delay(stack, d, opts, sched_dir))
                if a.out:
                    a.out.write_text(json.dumps({"delays": delays}, indent=1) + "\n")
        except KeyboardInterrupt:
            print("interrupted; keeping the delays that finished", file=sys.stderr)
        except StackError as e:  # the stack would not start or broke: said in words, its logs kept
            failed = str(e)
        finally:
            with signals_ignored():
                if stack.sched is not None:  # read live after each cell: not written out (minutes of text)
                    stack.sched.stop(keep=False)
                if a.keep_store is not None and delays:
                    keep_store(Path(stack.store.path), a.keep_store)
                stack.stop()
    if failed:
        where = "the stack wrote no logs"
        if (home / "logs").is_dir():
            kept = Path(tempfile.mkdtemp(prefix="kvlens-bench-links-failed-"))
            shutil.copytree(home / "logs", kept / "logs", dirs_exist_ok=True)
            where = f"the stack's logs are kept in {kept / 'logs'}"
        print(f"bench_links: {failed}\n{where}", file=sys.stderr)
    if delays:
        print_tables(delays)
    return 1 if failed else 0 if len(delays) == len(a.delays) else 130


if __name__ == "__main__":
    sys.exit(main())
