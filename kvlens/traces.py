"""``kvlens traces``: the slowest requests by handoff, with a text waterfall.

Lanes router / P / D; each phase is a bar on one time axis per trace; the
critical path (``prefill.finished`` -> ``kv.ready``) is marked on the axis and
phases inside it are drawn with ``#``, phases outside (push registration
overlapping prefill, P's queue+prefill) with ``=``; point phases are ``|``.
"""

from __future__ import annotations

import argparse
import json
import sys

from exporters import store
from instrumented_connector import semconv as sc
from kvlens import home

LANES = (("router", sc.Role.ROUTER.value), ("P", sc.Role.PREFILL.value), ("D", sc.Role.DECODE.value))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None, help="trace store (default $KVLENS_HOME/traces.db)")
    p.add_argument("--slowest", type=int, default=10, metavar="N", help="how many traces (default 10)")
    p.add_argument("--mode", choices=[m.value for m in sc.Mode], help="only push or pull")
    p.add_argument("--outcome", choices=[o.value for o in sc.Outcome], help="only this outcome")
    p.add_argument("--since", metavar="DUR", help="only requests started in the last DUR (30s, 10m, 2h, 1d)")
    p.add_argument("--trace", metavar="ID", help="one trace by id (32 hex)")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of text")
    p.add_argument("--width", type=int, default=60, help="waterfall width in characters")


def _fmt_s(v) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f}ms" if v < 10 else f"{v:.2f}s"


def waterfall(summary: dict, spans: list[dict], width: int = 60) -> str:
    """A text waterfall for one trace (pure function; tested)."""
    lines = [
        f"trace {summary['trace_id']}  mode={summary['mode']}  outcome={summary['outcome']}  "
        f"handoff={_fmt_s(summary['handoff_s'])}  ttft={_fmt_s(summary['ttft_s'])}  request={summary['request_id']}"
    ]
    if not spans:
        return lines[0] + "\n  (no spans)"
    t0 = min(s["start_ns"] for s in spans)
    t1 = max(s["end_ns"] for s in spans)
    span_ns = max(t1 - t0, 1)

    def col(t: int) -> int:
        return min(width - 1, max(0, int((t - t0) * (width - 1) / span_ns)))

    cp0, cp1 = summary.get("prefill_finished_ns"), summary.get("kv_ready_ns")
    axis = [" "] * width
    if cp0 and cp1:
        for i in range(col(cp0), col(cp1) + 1):
            axis[i] = "~"
    lines.append(f"  {'critical path':<30}[{''.join(axis)}]")
    name_w = 22
    for lane, role in LANES:
        lane_spans = sorted(
            (s for s in spans if s["role"] == role),
            key=lambda s: (s["start_ns"], sc.PHASE_ORDER.get(s["name"], 99)),
        )
        for s in lane_spans:
            bar = [" "] * width
            a, b = col(s["start_ns"]), col(s["end_ns"])
            on_cp = cp0 is not None and cp1 is not None and s["end_ns"] > cp0 and s["start_ns"] < cp1
            ch = "|" if s["start_ns"] == s["end_ns"] else ("#" if on_cp else "=")
            for i in range(a, b + 1):
                bar[i] = ch
            dur = (s["end_ns"] - s["start_ns"]) / 1e9
            flag = "" if s["outcome"] in (None, "ok") else f" !{s['outcome']}"
            lines.append(f"  {lane:<7}{s['name'][:name_w]:<{name_w + 1}}[{''.join(bar)}] {_fmt_s(dur)}{flag}")
    lines.append(f"  {'':<30} 0{'':>{width - 10}}{_fmt_s(span_ns / 1e9):>9}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    path = args.store or str(home.store_path())
    try:
        since = store.parse_since(args.since)
    except ValueError as e:
        print(f"kvlens traces: {e}", file=sys.stderr)
        return 2
    if args.slowest <= 0:
        print("kvlens traces: --slowest must be > 0", file=sys.stderr)
        return 2
    try:
        conn = store.connect(path, readonly=True)
    except FileNotFoundError as e:
        print(f"kvlens traces: {e} (run `kvlens up` and send requests, or pass --store)", file=sys.stderr)
        return 1
    with conn:
        rows = store.slowest(
            conn,
            args.slowest,
            mode=args.mode,
            outcome=args.outcome,
            since_ns=since,
            trace_ids=[args.trace.lower()] if args.trace else None,
        )
        if args.trace and not rows:
            print(f"kvlens traces: no trace {args.trace} in {path}", file=sys.stderr)
            return 1
        spans = store.spans_for(conn, [r["trace_id"] for r in rows])
    if args.json:
        for r in rows:
            print(json.dumps(store.trace_record(r, spans[r["trace_id"]])))
        return 0
    if not rows:
        print(f"no traces match in {path}")
        return 0
    for r in rows:
        print(waterfall(r, spans[r["trace_id"]], args.width))
        print()
    print("legend: # on the critical path (prefill.finished -> kv.ready), = off it (overlap), | point event")
    return 0
