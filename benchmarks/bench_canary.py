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
import statistics
import sys
import time
from pathlib import Path

from scratch import scratch_dir  # noqa: E402 (benchmarks/: the script's own directory)

from kvlens.bench.load import run_cell_async
from kvlens.bench.prompts import PromptMaker
from kvlens.bench.prompts import rng as seeded_rng
from kvlens.bench.results import Target
from kvlens.signals import sigterm_as_interrupt
from kvlens.stack.launch import Stack
from kvlens.stack.supervise import signals_ignored
from kvtrace import store, tracemodel
from kvtrace import whatif as kv_whatif
from kvtrace.borrowed import tiled_phases


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _settled(db, tids: list[str], timeout_s: float = 120.0) -> dict[str, tracemodel.Trace]:
    """The cell's traces once each has its handoff and router TTFT (or at the timeout)."""
    deadline = time.time() + timeout_s
    while True:
        with store.reading(db) as conn:
            got = tracemodel.find(conn, tids)
        if all(t in got and got[t].handoff_s is not None and got[t].ttft_source == "router" for t in tids):
            return got
        if time.time() > deadline:
            return got
        time.sleep(1.0)


def phase_medians(traces: list[tracemodel.Trace], top: int = 6) -> dict[str, float]:
    """The median of each phase's tiled share of the handoff over ``traces``
    (seconds; a phase a request lacks counts 0), the ``top`` largest: which
    phases a mode's measured handoff is made of, to name what breaks a
    prediction."""
    tiles = [tiled_phases(t) for t in traces if t.spans and t.handoff_s is not None]
    names = {n for tl in tiles for n in tl}
    med = {n: statistics.median([tl.get(n, 0.0) for tl in tiles]) for n in names} if tiles else {}
    return dict(sorted(med.items(), key=lambda kv: -kv[1])[:top])


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.0f} %"


def _row(cell: str, w: kv_whatif.WhatIf) -> dict:
    mt = w.measured_to
    out = {"cell": cell, "from": w.from_mode, "to": w.to_mode, "status": w.status, "note": w.note, "used": w.used}
    for key, fig in (("handoff", w.handoff), ("ttft", w.ttft)):
        out[key] = {
            "predicted_p50_s": fig.p50,
            "interval_s": None if fig.lo is None else [fig.lo, fig.hi],
            "measured_p50_s": mt.get(f"{key}_p50_s"),
            "error": mt.get(f"{key}_error"),
            "inside": mt.get(f"{key}_in_interval"),
        }
    out["measured_n"] = mt.get("n")
    return out


def _line(r: dict) -> str:
    cells = [r["cell"], f"{r['to']} from {r['from']} ({r['used']} / {r['measured_n']})"]
    for key in ("handoff", "ttft"):
        f = r[key]
        iv = f["interval_s"]
        pred = "-" if f["predicted_p50_s"] is None else f"{_ms(f['predicted_p50_s'])} [{_ms(iv[0])}-{_ms(iv[1])}]"
        inside = "-" if f["inside"] is None else ("yes" if f["inside"] else "no")
        cells += [pred, _ms(f["measured_p50_s"]), _pct(f["error"]), inside]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| cell | predicted (requests used / measured) | handoff p50 predicted, ms [95 %] | measured | error | inside "
    "| TTFT p50 predicted, ms [95 %] | measured | error | inside |\n|---|---|---|---|---|---|---|---|---|---|"
)


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
                    got = _settled(stack.store, tids)
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
                            + ", ".join(f"{n} {_ms(v)}" for n, v in med.items())
                        )
                        phases.append({"cell": cell, "mode": mode, "median_share_s": med})
                    for frm, to in (("pull", "push"), ("push", "pull")):
                        w = kv_whatif.predict(
                            frm, [t for t in traces if t.mode == frm], [t for t in traces if t.mode == to]
                        )
                        rows.append(_row(cell, w))
                        print(_line(rows[-1]), flush=True)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        finally:
            with signals_ignored():
                stack.stop()
    print("\n" + HEADER)
    for r in rows:
        print(_line(r))
    for frm in ("pull", "push"):
        mine = [r for r in rows if r["from"] == frm and r["handoff"]["inside"] is not None]
        inside = sum(bool(r["handoff"]["inside"]) for r in mine)
        errs = [abs(r["handoff"]["error"]) for r in mine if r["handoff"]["error"] is not None]
        ttft_in = sum(bool(r["ttft"]["inside"]) for r in mine)
        mae = statistics.median(errs) if errs else None
        print(
            f"{mine[0]['to'] if mine else '?'} from {frm}: handoff inside the interval in {inside} of {len(mine)} "
            f"cells (target >= 3 of 4), TTFT inside in {ttft_in} of {len(mine)}; median |error| of the handoff "
            f"p50 {'-' if mae is None else f'{mae * 100:.0f} %'} (target <= 25 %)"
        )
    if a.out:
        a.out.write_text(json.dumps({"rows": rows, "phases": phases}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
