"""``kvlens whatif --from pull|push``: for each request of one mode in the
window, the other mode's handoff and TTFT, predicted from the phases
measured in its trace and figures borrowed from the same traces, with an
interval and every assumption in words (docs/verdict.md). The model is
:mod:`kvtrace.whatif`'s, the same the dashboard's Compare page shows.

Where the window also holds measured requests of the other mode, their p50s
are shown beside the prediction, and whether they lie in its interval.
Exit codes as ``kvlens verdict``'s.
"""

from __future__ import annotations

import argparse
import json

from kvlens.verdict import add_common, sched_of, with_store
from kvrecord import semconv as sc
from kvtrace import stats
from kvtrace import whatif as kv_whatif


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "Every borrowed figure is printed with its source, every assumption in words; "
        "method and limits: docs/verdict.md."
    )
    p.add_argument(
        "--from",
        dest="from_mode",
        choices=[m.value for m in sc.Mode],
        required=True,
        help="the mode whose traces are measured; the other is predicted",
    )
    add_common(p)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}ms" if v < 10 else f"{v:.2f}s"


def _pct(v: float | None) -> str:
    return "unknown" if v is None else f"{v * 100:+.0f} %"


def _error(w: kv_whatif.WhatIf, key: str) -> str:
    """The p50's error, and the floor sampling alone sets under it (kvtrace.stats.sampling_floor)."""
    floor = w.measured_to.get(f"{key}_floor")
    return f"error {_pct(w.measured_to.get(f'{key}_error'))}; sampling alone: " + (
        "unknown" if floor is None else f"±{floor * 100:.0f} %"
    )


def text(w: kv_whatif.WhatIf, window: str) -> str:
    """``kvlens whatif``'s report (pure)."""
    head = f"what if the {w.from_mode} requests of the last {window} had run {w.to_mode}"
    skipped = "; ".join(f"{n} {why}" for why, n in sorted(w.skipped.items()))
    lines = [f"{head}: {w.used} requests used" + (f" (left out: {skipped})" if skipped else "")]
    if w.status != "ok":
        return "\n".join([*lines, f"{stats.NOT_ENOUGH}: {w.note}"])
    mf = w.measured_from
    for key, fig in (("handoff", w.handoff), ("ttft", w.ttft)):
        name = "handoff" if key == "handoff" else "TTFT"
        lines.append(
            f"  {name:<8} measured {w.from_mode} p50 {_s(mf.get(f'{key}_p50_s'))}; predicted {w.to_mode} p50 "
            f"{_s(fig.p50)} [{_s(fig.lo)}-{_s(fig.hi)}], p10-p90 {_s(fig.p10)}-{_s(fig.p90)}"
        )
        m = w.measured_to.get(f"{key}_p50_s")
        if m is not None:
            inside = "inside" if w.measured_to.get(f"{key}_in_interval") else "outside"
            lines.append(
                f"           measured {w.to_mode} p50 {_s(m)} in the same window ({inside} the interval; "
                f"{_error(w, key)})"
            )
    nw, ew = w.handoff_nowait, w.handoff_expected_wait
    if nw.p50 is None:
        lines.append("  without CPU wait: unknown (no measured request carries CPU figures, kvlens.cpu.*)")
    else:
        lines.append(
            f"  handoff without CPU wait: predicted {w.to_mode} p50 {_s(nw.p50)} [{_s(nw.lo)}-{_s(nw.hi)}]; with "
            f"{w.to_mode}'s expected CPU wait here ({_s(w.measured_to.get('expected_cpu_wait_s'))}, measured in "
            f"{w.measured_to.get('expected_cpu_wait_from') or '-'}'s traces): {_s(ew.p50)} [{_s(ew.lo)}-{_s(ew.hi)}]"
        )
        m = w.measured_to.get("handoff_nowait_p50_s")
        if m is not None:
            inside = "inside" if w.measured_to.get("handoff_nowait_in_interval") else "outside"
            lines.append(
                f"           measured {w.to_mode} p50 without CPU wait {_s(m)} ({inside} the interval; "
                f"{_error(w, 'handoff_nowait')})"
            )
    lines.append("borrowed figures (p50 of what was measured):")
    for b in w.borrowed:
        v = stats.percentile(b.values, 50)
        shown = "-" if v is None else f"{v * 8 / 1e9:.2f} Gb/s" if b.unit == "bytes/s" else _s(v)
        lines.append(f"  {b.name}: {shown} over {len(b.values)} requests, from {b.source}")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in w.assumptions()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    sched = sched_of("whatif", args)
    rc, w = with_store(
        "whatif", args, lambda conn, since: kv_whatif.from_store(conn, since, args.from_mode, sched=sched)
    )
    if rc:
        return rc
    print(json.dumps({"window": args.window, **w.to_json()}) if args.json else text(w, args.window))
    return 0
