"""How much of the P->D handoff has a name: per mode (and push dispatch), the
unattributed share of the handoff at the median over requests, with and
without the derived phases, for one or more trace stores (the before /
after figure of adding derived phases: how much of the handoff they name).

    python benchmarks/handoff_tiling.py STORE [STORE ...] [--since 1h] [--json]

Unattributed = handoff - the union of the named critical intervals
(``kvtrace.tracemodel.tile``). "recorded" counts only spans some process
recorded (what a store named before derived phases existed); "named" adds
the phases ``tracemodel`` derives from two recorded timestamps. Goal:
named <= 10 % at the median, push and pull. ``kvlens traces --breakdown``
prints the same breakdown with the shares per phase and the unnamed gaps.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvtrace import costs, store, tracemodel

GOAL = 0.10


def figures(path: str, since: str | None = None) -> dict[str, dict[str, float | int | None]]:
    """``{group: {"requests", "recorded", "named", "dominant"}}`` for one store;
    shares are medians over requests (``None`` without requests)."""
    with store.reading(path) as conn:
        since_ns = store.parse_since(since)
        named = costs.breakdown(conn, by_dispatch=True, since_ns=since_ns)
        recorded = costs.breakdown(conn, by_dispatch=True, derived=False, since_ns=since_ns)
    return {
        k: {
            "requests": b.requests,
            "recorded": recorded[k].median_unattributed_share,
            "named": b.median_unattributed_share,
            "dominant": tracemodel.dominant_words(b),
        }
        for k, b in sorted(named.items())
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stores", nargs="+", help="trace store files (traces.db)")
    ap.add_argument("--since", help="only requests started in the last DUR (30s, 10m, 2h)")
    ap.add_argument("--json", action="store_true", help="one JSON object per store")
    args = ap.parse_args(argv)
    ok = True
    for path in args.stores:
        try:
            figs = figures(path, args.since)
        except store.StoreError as e:
            print(f"handoff_tiling: {e}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps({"store": path, "groups": figs}))
            continue
        print(f"{path}: unattributed share of the handoff, median over requests (goal <= {GOAL:.0%})")
        for key, f in figs.items():
            rec, nam = f["recorded"], f["named"]
            mark = "" if nam is None or nam <= GOAL else "  (above goal)"
            ok &= nam is None or nam <= GOAL or "/" in key
            print(
                f"  {key:<16} {f['requests']:>5} requests  recorded only {_pct(rec):>7}  "
                f"with derived {_pct(nam):>7}{mark}"
            )
        for key, f in figs.items():
            if "/" not in key:
                print(f"  {f['dominant']}")
    return 0 if ok else 3


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f} %"


if __name__ == "__main__":
    sys.exit(main())
