"""``kvlens traces --open``: the handoffs stuck now, from their partial
traces (:func:`kvtrace.stuck.stuck`; docs/handoff-health.md, "Stuck now")."""

from __future__ import annotations

import argparse
import json
import time

from kvtrace import store, stuck

#: --open's default --since: an open handoff's process re-reports it every few
#: seconds, so one not reported for a minute is no longer "stuck now".
OPEN_SINCE_DEFAULT = "1m"


def utc_clock(ns: int) -> str:
    t = time.gmtime(ns / 1e9)
    return time.strftime("%H:%M:%S", t) + f".{int(ns % 1_000_000_000) // 100_000_000}"


def fmt_age(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.1f}m"


def open_text(sides: list[stuck.OpenSide], now_ns: int, where: str, since: str) -> str:
    """``--open``'s table (pure; tested): one line per side stuck now, oldest first,
    or one line saying there is none."""
    if not sides:
        return f"no handoff stuck now in {where} (none open and reported in the last {since})"
    head = ("TRACE", "REQUEST", "MODE", "WAITING", "PHASE", "SINCE (UTC)", "AGE", "LAST REPORT", "NOTE")
    rows = []
    for o in sides:
        note = "registration timed out" if o.registration_timeout else ""
        rows.append(
            (
                o.trace_id,
                o.request_id or "-",
                o.mode or "-",
                f"{o.side} ({o.role})",
                o.phase or "-",
                utc_clock(o.since_ns),
                fmt_age(o.age_s(now_ns)),
                f"{fmt_age(max(now_ns - o.seen_ns, 0) / 1e9)} ago",
                note,
            )
        )
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    lines = [f"{len(sides)} handoff side(s) stuck now in {where} (open, reported in the last {since}):"]
    for r in (head, *rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lines.append("each is a partial trace: `kvlens traces --trace ID` shows it as far as it got")
    return "\n".join(lines)


def run_open(path: store.StoreLocation, args: argparse.Namespace) -> int:
    """Print the handoffs stuck now (text or ``--json``): 0. Store errors propagate
    (``kvlens.traces.run`` turns them into one line and exit 1)."""
    since = args.since or OPEN_SINCE_DEFAULT
    with store.reading(path) as conn:
        sides = stuck.stuck(conn, since_ns=store.parse_since(since), mode=args.mode)
    now = time.time_ns()
    if args.json:
        for o in sides:
            print(json.dumps(o.to_json(now)))
        return 0
    print(open_text(sides, now, str(path), since))
    return 0
