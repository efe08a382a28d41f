"""``kvlens traces``: the slowest requests by handoff, with a text waterfall.

Lanes router / P / D; each phase is a bar on one time axis per trace; the
critical path (``prefill.finished`` -> ``kv.ready``) is marked on the axis and
phases on it are drawn with ``#``, phases off it (push registration
overlapping prefill, P's queue+prefill, the root ``request``) with ``=``;
point phases are ``|``. Which span is on the critical path is
:mod:`kvtrace.tracemodel`'s decision, the same the dashboard shows. The
first cells of a span's bar are drawn ``░`` in proportion to the CPU wait of
the thread that ended it (runnable, waiting for a CPU; ``kvlens.cpu.wait_s``);
a line under the waterfall splits the handoff into CPU wait, CPU work,
off-CPU and unknown (:mod:`kvtrace.cpusplit`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from pathlib import Path

from kvlens import exits
from kvrecord.argtypes import duration_text, int_in
from kvrecord import config
from kvrecord import semconv as sc
from kvtrace import costs, cpucounters, cpusplit, kvuse, perfetto, ranks, store, stuck, tracemodel
from kvlens.verdict import sched_of
from kvlens.stuckcmd import OPEN_SINCE_DEFAULT, utc_clock, fmt_age, run_open
from kvrecord.keeprule import NOT_KEPT
from kvtrace.tracemodel import NOT_KEPT_NOTE, Trace

LANES = (("router", sc.Role.ROUTER.value), ("P", sc.Role.PREFILL.value), ("D", sc.Role.DECODE.value))
_LANE_OF = {role: lane for lane, role in LANES}


#: Most traces one call prints (--slowest); the store's LIMIT is a 64-bit
#: integer, and a terminal does not need more.
MAX_SLOWEST = 10_000
#: Narrowest and widest waterfall (--width, characters of the time axis):
#: below MIN_WIDTH the axis has no room for its end label.
MIN_WIDTH, MAX_WIDTH = 20, 1000
#: Longest --since (100 years): "everything" without an overflowing bound.
MAX_SINCE_S = 100 * 365 * 86400


#: The glyph of a bar's CPU-wait part (its first cells, in proportion).
CPU_WAIT = "░"
#: The line under the waterfalls.
LEGEND = (
    "legend: # on the critical path (prefill.finished -> kv.ready), = off it (overlap), | point event, "
    f"{CPU_WAIT} the part of the span its thread waited for a CPU (runnable, not running: host contention; "
    "drawn first, its place within the span is not known)"
)


#: argparse ``type=`` of --since
since_arg = duration_text(MAX_SINCE_S)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=None,
        help="trace store: a SQLite file or a postgresql://user@host:port/db URL (default $KVLENS_HOME/traces.db)",
    )
    p.add_argument(
        "--slowest",
        type=int_in(1, MAX_SLOWEST),
        default=10,
        metavar="N",
        help=f"how many traces (default 10, at most {MAX_SLOWEST})",
    )
    p.add_argument("--mode", choices=[m.value for m in sc.Mode], help="only push or pull")
    p.add_argument("--outcome", choices=[o.value for o in sc.Outcome], help="only this outcome")
    p.add_argument(
        "--since", metavar="DUR", type=since_arg, help="only requests started in the last DUR (30s, 10m, 2h, 1d)"
    )
    p.add_argument("--p-engine", metavar="ENGINE", help="only requests prefilled by this P engine id (e.g. p1)")
    p.add_argument("--d-engine", metavar="ENGINE", help="only requests decoded by this D engine id (e.g. d0)")
    p.add_argument(
        "--half",
        choices=["prefill", "decode"],
        help="only half traces: requests whose other side never joined (docs/phases.md, 'Trace correlation')",
    )
    p.add_argument("--trace", metavar="ID", help="one trace by id (32 hex)")
    p.add_argument(
        "--open",
        action="store_true",
        help="instead of waterfalls: the handoffs stuck now, from their partial traces (trace id, request id, "
        "mode, the side that waits, phase, since when, age, last report); only those reported within --since "
        f"(default {OPEN_SINCE_DEFAULT}); with --mode, one mode (docs/handoff-health.md)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of text")
    p.add_argument(
        "--sched",
        metavar="DIR",
        help="the kernel's scheduler record kept by `kvlens up --sched-trace` (<log dir>/sched): every phase "
        "but the transfer itself takes its CPU work, CPU wait and off-CPU time from its critical path "
        "through it, across threads and processes (docs/phases.md, 'The kernel's record')",
    )
    p.add_argument(
        "--width",
        type=int_in(MIN_WIDTH, MAX_WIDTH),
        default=60,
        help=f"waterfall width in characters ({MIN_WIDTH}..{MAX_WIDTH}, default 60)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="instead of waterfalls: per mode (and push dispatch), what the handoff is made of, "
        "the unattributed share at the median, and the unnamed gaps "
        f"(newest {costs.BREAKDOWN_SAMPLE} completed traces matching the filters)",
    )
    p.add_argument(
        "--perfetto",
        metavar="FILE",
        help="write the traces asked for (--trace ID, or --slowest N with the filters) as Chrome "
        "trace-event JSON for ui.perfetto.dev / chrome://tracing; - for stdout",
    )


def _fmt_s(v) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f}ms" if v < 10 else f"{v:.2f}s"


def _fmt_handoff(trace: Trace) -> str:
    """``12.3ms±0.4ms`` (the clock bound), or ``unknown (why)``, or ``-``."""
    if trace.handoff_s is None:
        return f"unknown ({trace.handoff_note})" if trace.handoff_note else "-"
    if trace.handoff_err_s is None:
        return _fmt_s(trace.handoff_s)
    return f"{_fmt_s(trace.handoff_s)}±{_fmt_s(trace.handoff_err_s)}"


def _fmt_ttft(trace: Trace) -> str:
    """``412.0ms (router)``, ``398.1ms±0.3ms (engines)``, or ``-``."""
    if trace.ttft_s is None:
        return "-"
    err = f"±{_fmt_s(trace.ttft_err_s)}" if trace.ttft_err_s else ""
    return f"{_fmt_s(trace.ttft_s)}{err} ({trace.ttft_source or 'router'})"


def _filters(args: argparse.Namespace) -> dict:
    """The store filters the command line asks for (``store.TraceFilter`` fields)."""
    return {
        "mode": args.mode,
        "outcome": args.outcome,
        "since_ns": store.parse_since(args.since),
        "p_engine": getattr(args, "p_engine", None),
        "d_engine": getattr(args, "d_engine", None),
        "half": getattr(args, "half", None),
    }


def _health_lines(trace: Trace) -> list[str]:
    """A partial trace's ``OPEN:`` line per waiting side, a stale one's ``STALE:`` line."""
    lines = []
    for o in trace.open:
        flag = ", push registration timed out" if o.registration_timeout else ""
        lines.append(
            f"  OPEN: {o.side} ({o.role}) waiting in {o.phase or '?'} since {utc_clock(o.since_ns)} UTC, "
            f"{fmt_age(o.waited_s)} at its last report ({utc_clock(o.seen_ns)}){flag}: a partial trace, "
            "as far as the handoff got"
        )
    if trace.stale:
        lines.append(f"  STALE: {stuck.STALE_WHY}: {stuck.STALE_WORDS}")
    return lines


def waterfall(trace: Trace, width: int = 60) -> str:
    """A text waterfall for one trace (pure function; tested). ``width`` is
    clamped to MIN_WIDTH..MAX_WIDTH."""
    width = min(MAX_WIDTH, max(MIN_WIDTH, int(width)))
    outcome = "open" if trace.open else trace.outcome
    lines = [
        f"trace {trace.trace_id}  mode={trace.mode}  outcome={outcome}  "
        f"handoff={_fmt_handoff(trace)}  ttft={_fmt_ttft(trace)}  P={trace.p_engine or '-'}  "
        f"D={trace.d_engine or '-'}  request={trace.request_id}"
    ]
    lines += _health_lines(trace)
    if trace.half:
        other = "D" if trace.half == sc.Role.PREFILL.value else "P"
        lines.append(
            f"  half a trace: no span of {other}'s joined it (a router that gave {other} another request "
            "id and no kv_transfer_params link; docs/phases.md, 'Trace correlation')"
        )
    if trace.clock_offset_s:
        lines.append(f"  D's clock {trace.clock_offset_s * 1000:+.2f}ms off P's: D's spans shown on P's clock")
    spans = trace.spans
    if not spans and trace.keep == NOT_KEPT:
        ph = "  ".join(f"{p}={v * 1000:.1f}ms" for p, v in trace.phases.items())
        return "\n".join([*lines, f"  ({NOT_KEPT_NOTE})", *([f"  phases: {ph}"] if ph else [])])
    if not spans:
        return lines[0] + "\n  (no spans)"
    t0 = min(s.start_ns for s in spans)
    t1 = max(s.end_ns for s in spans)
    span_ns = max(t1 - t0, 1)

    def col(t: int) -> int:
        return min(width - 1, max(0, int((t - t0) * (width - 1) / span_ns)))

    axis = [" "] * width
    if trace.window:
        for i in range(col(trace.window[0]), col(trace.window[1]) + 1):
            axis[i] = "~"
    lines.append(f"  {'critical path':<30}[{''.join(axis)}]")
    name_w = 22
    multi = any(n > 1 for n in ranks.tp_sizes(spans).values())
    for lane, role in LANES:
        lane_spans = sorted(
            (s for s in spans if s.role == role),
            key=lambda s: ((ranks.rank_of(s) or 0) if multi else 0, s.start_ns, sc.PHASE_ORDER.get(s.name, 99)),
        )
        for s in lane_spans:
            label = ranks.lane(lane, s, multi)
            bar = [" "] * width
            ch = "|" if s.start_ns == s.end_ns else ("#" if s.critical else "=")
            a, z = col(s.start_ns), col(s.end_ns)
            for i in range(a, z + 1):
                bar[i] = ch
            for i in range(a, a + _wait_cells(s, z - a + 1)):
                bar[i] = CPU_WAIT
            flag = "" if s.outcome in (None, "ok") else f" !{s.outcome}"
            lines.append(f"  {label:<7}{s.name[:name_w]:<{name_w + 1}}[{''.join(bar)}] {_fmt_s(s.duration_s)}{flag}")
    lines.append(f"  {'':<30} 0{'':>{width - 10}}{_fmt_s(span_ns / 1e9):>9}")
    return "\n".join(lines + _cpu_lines(trace) + _waterfall_notes(spans))


def _wait_cells(s, cells: int) -> int:
    """How many of a span's ``cells`` show its thread's CPU wait (0: none, or no figures)."""
    fig = cpucounters.span_figures(s.attributes or {})
    if fig is None or s.end_ns <= s.start_ns or fig.wait_s <= 0:
        return 0
    return min(cells, round(cells * fig.wait_s * 1e9 / (s.end_ns - s.start_ns)))


#: Lines under a waterfall (and the legend) wrap at this many columns.
TEXT_WIDTH = 120


def _wrapped(line: str) -> list[str]:
    """``line`` (its own indent kept) wrapped at spaces to :data:`TEXT_WIDTH`, continuations 4 deeper."""
    lead = " " * (len(line) - len(line.lstrip(" ")))
    return textwrap.wrap(
        line.strip(),
        TEXT_WIDTH,
        initial_indent=lead,
        subsequent_indent=lead + "    ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def _ms(v: float) -> str:
    return f"{v * 1000:.1f} ms"


def _cpu_lines(trace: Trace) -> list[str]:
    """The handoff split into CPU wait, CPU work, off-CPU and unknown; the
    progress thread's figures on the wire phases (it spins: said so)."""
    split = cpusplit.handoff_cpu(trace)
    if split.handoff_s is None:
        return []
    h = split.handoff_s
    if split.cpu_wait_s is None:
        lines = [f"  handoff {_ms(h)}: CPU wait unknown ({cpusplit.unknown_reason(split)})"]
    else:
        lines = [
            f"  handoff {_ms(h)}: CPU wait {_ms(split.cpu_wait_s)} ({split.cpu_wait_s / h * 100:.0f} %), "
            f"CPU work {_ms(split.cpu_on_s or 0.0)}, off-CPU {_ms(split.off_cpu_s or 0.0)}, "
            f"unknown {_ms(split.unknown_s or 0.0)} (the transfer itself, derived phases, unnamed gaps)"
        ]
        why: dict[str, list[str]] = {}
        for phase, note in split.notes.items():
            if note not in (cpusplit.DERIVED_NOTE, cpusplit.SPIN_NOTE):
                why.setdefault(note, []).append(phase)
        lines += [f"  no CPU figures on {', '.join(ps)} (in unknown): {note}" for note, ps in why.items()]
    for phase, f in sorted(cpusplit.wire_progress(trace).items()):
        on, wait = f.get("on_s"), f.get("wait_s")
        lines.append(
            f"  progress thread over {phase}: on CPU {'?' if on is None else _ms(on)}, "
            f"CPU wait {'?' if wait is None else _ms(wait)} ({cpusplit.SPIN_NOTE})"
        )
    return [w for line in lines for w in _wrapped(line)]


def _waterfall_notes(spans) -> list[str]:
    """The lines under a waterfall: TP stragglers, KV recomputed."""
    lines = []
    for x in ranks.stragglers(spans):
        side = _LANE_OF.get(x.role, x.role)
        lines.append(
            f"  straggler: {side} rank {x.rank} finished {x.phase} last, {_fmt_s(x.lag_s)} after rank "
            f"{x.first_rank} ({x.ranks} ranks; the request waits for the last)"
        )
    use = kvuse.trace_kv_use(spans)
    if use and use["recomputed"]:
        lines.append(
            f"  KV recomputed: D computed {use['recomputed_tokens']} prompt tokens itself at its first step "
            "(more than the last partial block): the KV that moved was not used"
        )
    return lines


def breakdown_text(groups: dict[str, tracemodel.Breakdown], gaps: int = 5) -> str:
    """The ``--breakdown`` report (pure; tested): per group, the sentence of
    :func:`tracemodel.dominant_words`, every phase's share of the summed
    handoff, and the unnamed stretches holding the most time, named by the
    timestamps around them."""
    if not groups:
        return "no completed handoff to break down"
    lines = []
    order = sorted(groups, key=lambda k: (k.split("/")[0] != "push", "/" in k, k))
    for key in order:
        b = groups[key]
        whole = groups.get(key.split("/")[0])
        if "/" in key and whole is not None and whole.requests == b.requests:
            continue  # the mode's only dispatch: the same figures again
        med = b.median_unattributed_share
        lines.append(tracemodel.dominant_words(b))
        lines.append(
            f"  {b.requests} requests, mean handoff {_fmt_s(b.handoff_ns / b.requests / 1e9)}, "
            f"unattributed at the median {'-' if med is None else f'{med * 100:.1f} %'}"
        )
        lines.append("  " + cpu_share_words(b))
        for name, share in b.shares():
            ns = b.unattributed_ns if name == tracemodel.UNATTRIBUTED else b.phases[name]
            lines.append(f"    {name:<22}{share * 100:6.1f} %  {_fmt_s(ns / b.requests / 1e9):>9}/request")
        top = b.top_gaps(gaps)
        if top:
            lines.append("  unnamed gaps (timestamp before -> after: requests, total, median):")
            for a, z, n, tot, mid in top:
                lines.append(f"    {a} -> {z}: {n}, {_fmt_s(tot / 1e9)}, {_fmt_s(mid / 1e9)}")
        lines.append("")
    return "\n".join(lines).rstrip()


def cpu_share_words(b: tracemodel.Breakdown) -> str:
    """A group's median CPU-wait share of the handoff, over the requests with
    CPU figures; "unknown (why)" where none had them."""
    n = len(b.cpu_wait_shares)
    unknown = sum(b.cpu_unknown.values())
    if not n:
        why = max(b.cpu_unknown, key=b.cpu_unknown.get) if b.cpu_unknown else cpusplit.NO_FIGURES
        return f"CPU wait: unknown ({why})"
    rest = f"; {unknown} without CPU figures" if unknown else ""
    return (
        f"CPU wait: {b.median_cpu_wait_share * 100:.1f} % of the handoff at the median "
        f"(threads runnable, waiting for a CPU; {n} requests with CPU figures{rest})"
    )


def _load_breakdown(path: store.StoreLocation, args: argparse.Namespace) -> dict[str, tracemodel.Breakdown]:
    with store.reading(path) as conn:
        return costs.breakdown(conn, by_dispatch=True, **_filters(args))


def _summary_lines(path: store.StoreLocation, args: argparse.Namespace) -> list[str]:
    """The closing "what dominates" line per mode under the waterfalls."""
    with store.reading(path) as conn:
        groups = costs.breakdown(conn, **_filters(args))
    return [
        tracemodel.dominant_words(groups.get(m), m)
        for m in (m.value for m in sc.Mode)
        if not args.mode or args.mode == m
    ]


def _load(path: store.StoreLocation, args: argparse.Namespace) -> list[Trace]:
    """The traces asked for; raises ``store.StoreError`` (one printable line)."""
    with store.reading(path) as conn:
        return tracemodel.slowest(
            conn,
            args.slowest,
            order="start" if getattr(args, "half", None) else "handoff",  # a half trace has no handoff
            trace_ids=[args.trace.lower()] if args.trace else None,
            **_filters(args),
        )


def _write_perfetto(out: str, traces: list[Trace], path: store.StoreLocation) -> int:
    """Write ``--perfetto``'s file (``-``: stdout; then the summary goes to
    stderr): 0; 2 when the file cannot be written."""
    if not traces:
        print(f"no traces match in {path}; {out} not written", file=sys.stderr)
        return 0
    doc = perfetto.document(traces)
    text = json.dumps(doc, separators=(",", ":"))
    summary = f"wrote {len(traces)} trace(s), {len(doc['traceEvents'])} events to {out}"
    if out == "-":
        sys.stdout.write(text + "\n")
        print(summary.replace(" to -", " to stdout"), file=sys.stderr)
        return 0
    try:
        Path(out).write_text(text + "\n", encoding="utf-8")
    except OSError as e:
        print(f"kvlens traces: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return exits.USAGE
    print(summary + " (open it in ui.perfetto.dev or chrome://tracing)")
    return 0


def run(args: argparse.Namespace) -> int:
    """Print the traces asked for: 0, else one line on stderr naming the
    problem and :mod:`kvlens.exits`' code: 2 for a bad value (callers that
    build ``args`` themselves skip argparse's checks) or a store that cannot
    be used (missing, not a store, a directory, a malformed URL), 1 for a
    server that cannot be reached now or a trace that is not in the store."""
    try:
        since_arg(args.since) if args.since else None
        int_in(1, MAX_SLOWEST)(str(args.slowest))
        path = store.StoreLocation.parse(args.store) if args.store else config.default_store()
    except argparse.ArgumentTypeError as e:
        print(f"kvlens traces: {e}", file=sys.stderr)
        return exits.USAGE
    except store.StoreError as e:  # a malformed store URL
        return exits.store_exit("traces", e)
    if not path.is_postgres and path.path.is_dir():  # the store's reader lets sqlite's "disk I/O error" through
        print(f"kvlens traces: {path} is a directory, not a trace store file", file=sys.stderr)
        return exits.USAGE
    try:
        if getattr(args, "open", False):
            return run_open(path, args)
        if getattr(args, "breakdown", False):
            print(breakdown_text(_load_breakdown(path, args)))
            with store.reading(path) as conn:
                n = costs.summary_only(conn, **_filters(args))
            if n:
                print(f"\n{n} completed requests kept as summaries only (--keep sampled) are not in this breakdown")
            return 0
        traces = _load(path, args)
        sched = sched_of("traces", args)  # the kernel's record: the CPU split walks it
        if sched is not None:
            traces = [dataclasses.replace(t, sched=sched) for t in traces]
        quiet = args.json or args.trace or getattr(args, "perfetto", None) or not traces
        summary = [] if quiet else _summary_lines(path, args)
    except store.StoreError as e:
        return exits.store_exit("traces", e)
    if args.trace and not traces:
        print(f"kvlens traces: no trace {args.trace} in {path}", file=sys.stderr)
        return exits.FAILED
    if getattr(args, "perfetto", None):
        return _write_perfetto(args.perfetto, traces, path)
    if args.json:
        for t in traces:
            print(json.dumps(t.to_json()))
        return 0
    if not traces:
        print(f"no traces match in {path}")
        return 0
    for t in traces:
        print(waterfall(t, args.width))
        print()
    print("\n".join(_wrapped(LEGEND)))
    if summary:
        print(
            f"\nwhat the handoff is made of (newest {costs.BREAKDOWN_SAMPLE} completed traces; details: --breakdown):"
        )
        for line in summary:
            print("  " + line)
    return 0
