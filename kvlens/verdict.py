"""``kvlens verdict``: push against pull on the live traffic of one window of
the store, prompt length against prompt length (docs/verdict.md).

Per figure (TTFT p50 and p90, handoff p50, TPOT p50): the push/pull ratio,
stratified by prompt-length bucket, with its 95 % interval; "no resolvable
difference" where the interval holds 1, "not enough data" below
``kvtrace.stats.MIN_PER_STRATUM`` requests per mode and bucket; the counts
per mode and bucket. Where the window holds requests a router's split
assigned (a canary), only those are compared. The statistics are
:mod:`kvtrace.verdict`'s, the same the dashboard's headline shows.

Exit codes: 0 a verdict (whatever it says, "needs both modes" included);
2 a bad ``--window`` or ``--store`` (no store there, not a store, a bad
URL); 1 a store that cannot be reached now (PostgreSQL down).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from kvrecord import config
from kvlens import exits
from kvrecord.argtypes import duration_text
from kvtrace import schedtrace, store
from kvtrace import verdict as kv_verdict

#: The longest --window (a year): "everything recent" without an overflowing bound.
MAX_WINDOW_S = 365 * 86400
DEFAULT_WINDOW = "1h"


#: argparse ``type=`` of --window
window_arg = duration_text(MAX_WINDOW_S)


def add_common(p: argparse.ArgumentParser) -> None:
    """--window, --store, --json: what ``verdict`` and ``whatif`` share."""
    p.add_argument(
        "--window",
        type=window_arg,
        default=DEFAULT_WINDOW,
        metavar="DUR",
        help=f"the requests that started in the last DUR (30m, 1h, 1d; default {DEFAULT_WINDOW})",
    )
    p.add_argument(
        "--store",
        default=None,
        help="trace store: a SQLite file or a postgresql://user@host:port/db URL (default $KVLENS_HOME/traces.db)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.add_argument(
        "--sched",
        metavar="DIR",
        help="the kernel's scheduler record kept by `kvlens up --sched-trace` (<log dir>/sched): the handoff's "
        "CPU wait walks every phase's critical path through it (docs/phases.md, 'The kernel's record')",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "Ratios are push/pull: below 1 push is faster. Needs push and pull requests in the same window, "
        "ideally assigned at random by kvlens' router (--split), so both modes see the same traffic."
    )
    add_common(p)


def with_store(cmd: str, args: argparse.Namespace, read: Callable[[Any, int], Any]) -> tuple[int, Any]:
    """Check ``args``' window and store, then ``read(conn, since_ns)`` on a
    read-only connection: (0, its result), or (exit code, None) after one
    line on stderr naming the problem (the codes: :mod:`kvlens.exits`)."""
    try:
        window_arg(args.window)
        loc = store.StoreLocation.parse(args.store) if args.store else config.default_store()
    except argparse.ArgumentTypeError as e:
        print(f"kvlens {cmd}: {e}", file=sys.stderr)
        return exits.USAGE, None
    except store.StoreError as e:  # a malformed store URL
        return exits.store_exit(cmd, e), None
    if not loc.is_postgres and loc.path.is_dir():
        print(f"kvlens {cmd}: {loc} is a directory, not a trace store file", file=sys.stderr)
        return exits.USAGE, None
    try:
        with store.reading(loc) as conn:
            return exits.OK, read(conn, store.parse_since(args.window))
    except store.StoreError as e:
        return exits.store_exit(cmd, e), None


def sched_of(cmd: str, args: argparse.Namespace) -> Any:
    """The kernel's scheduler record ``--sched`` names, read; None where none
    is asked for, or it cannot be read (said on stderr, once: the per-thread
    counters' figures stand)."""
    folder = getattr(args, "sched", None)
    if not folder:
        return None
    try:
        tl = schedtrace.load(folder)
    except schedtrace.SchedUnavailable as e:
        print(f"kvlens {cmd}: --sched: {e}; CPU figures from the per-thread counters only", file=sys.stderr)
        return None
    if tl.lost or tl.missed:  # counted, never silent: a walk across a gap stops there (more off-CPU)
        print(
            f"kvlens {cmd}: --sched: the kernel's record lost {tl.lost} events and misses {tl.missed} switch-ins; "
            "a phase walked across one stops there",
            file=sys.stderr,
        )
    return tl


def run(args: argparse.Namespace) -> int:
    sched = sched_of("verdict", args)
    rc, v = with_store("verdict", args, lambda conn, since: kv_verdict.from_store(conn, since_ns=since, sched=sched))
    if rc:
        return rc
    if args.json:
        print(json.dumps({"window": args.window, **v.to_json()}))
    else:
        print(kv_verdict.text(v, args.window))
    return 0
