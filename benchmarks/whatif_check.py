"""The what-if checked against measurement, shared by the benchmarks that do
it (``bench_canary.py`` on a loopback mixed fleet, ``bench_links.py`` on
shaped links): wait for a cell's traces, predict each mode from the other's
traces (:func:`kvtrace.whatif.predict`), and say per cell and direction the
predicted p50 handoff and TTFT with their 95 % intervals, the measured p50s,
the error ((predicted - measured) / measured) and whether the measured
value lies in the interval; plus each mode's median tiled phases (what a
miss is made of). Reads the store; prints nothing itself."""

from __future__ import annotations

import statistics
import time

from kvtrace import store, tracemodel
from kvtrace import whatif as kv_whatif
from kvtrace.borrowed import tiled_phases

#: The directions checked per cell: (from, to).
DIRECTIONS = (("pull", "push"), ("push", "pull"))


def settled(db, tids: list[str], timeout_s: float = 120.0) -> dict[str, tracemodel.Trace]:
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


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.0f} %"


def check_row(cell: str, w: kv_whatif.WhatIf) -> dict:
    """One direction of one cell as a JSON-able dict."""
    mt = w.measured_to
    out = {"cell": cell, "from": w.from_mode, "to": w.to_mode, "status": w.status, "note": w.note, "used": w.used}
    for key, fig in (("handoff", w.handoff), ("ttft", w.ttft), ("handoff_nowait", w.handoff_nowait)):
        out[key] = {
            "predicted_p50_s": fig.p50,
            "interval_s": None if fig.lo is None else [fig.lo, fig.hi],
            "measured_p50_s": mt.get(f"{key}_p50_s"),
            "error": mt.get(f"{key}_error"),
            "inside": mt.get(f"{key}_in_interval"),
            "floor": mt.get(f"{key}_floor"),
        }
    out["measured_n"] = mt.get("n")
    out["expected_cpu_wait_s"] = mt.get("expected_cpu_wait_s")
    return out


def check_cell(cell: str, traces: list[tracemodel.Trace]) -> list[dict]:
    """Both directions of one cell whose ``traces`` hold both modes' requests."""
    return [
        check_row(
            cell, kv_whatif.predict(frm, [t for t in traces if t.mode == frm], [t for t in traces if t.mode == to])
        )
        for frm, to in DIRECTIONS
    ]


def line(r: dict) -> str:
    """A markdown table line of :data:`HEADER`."""
    cells = [r["cell"], f"{r['to']} from {r['from']} ({r['used']} / {r['measured_n']})"]
    for key in ("handoff", "ttft", "handoff_nowait"):
        f = r.get(key) or {
            "predicted_p50_s": None,
            "interval_s": None,
            "measured_p50_s": None,
            "error": None,
            "inside": None,
        }
        iv = f["interval_s"]
        pred = "-" if f["predicted_p50_s"] is None else f"{ms(f['predicted_p50_s'])} [{ms(iv[0])}-{ms(iv[1])}]"
        inside = "-" if f["inside"] is None else ("yes" if f["inside"] else "no")
        cells += [pred, ms(f["measured_p50_s"]), pct(f["error"]), inside]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| cell | predicted (requests used / measured) | handoff p50 predicted, ms [95 %] | measured | error | inside "
    "| TTFT p50 predicted, ms [95 %] | measured | error | inside "
    "| handoff p50 without CPU wait, predicted [95 %] | measured | error | inside |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def coverage_lines(rows: list[dict], target_cells: str = "3 of 4") -> list[str]:
    """Per direction: in how many cells the measured handoff / TTFT lay inside
    the interval, and the median absolute error of the handoff p50."""
    out = []
    for frm, to in DIRECTIONS:
        for key, words in (("handoff", "handoff"), ("handoff_nowait", "handoff without CPU wait")):
            mine = [r for r in rows if r["from"] == frm and (r.get(key) or {}).get("inside") is not None]
            inside = sum(bool(r[key]["inside"]) for r in mine)
            errs = [abs(r[key]["error"]) for r in mine if r[key]["error"] is not None]
            mae = statistics.median(errs) if errs else None
            floors = [r[key]["floor"] for r in mine if r[key].get("floor") is not None]
            floor = statistics.median(floors) if floors else None
            ttft = ""
            if key == "handoff":
                ttft = f", TTFT inside in {sum(bool(r['ttft']['inside']) for r in mine)} of {len(mine)}"
            out.append(
                f"{to} from {frm}, {words}: inside the interval in {inside} of {len(mine)} cells (target >= "
                f"{target_cells}){ttft}; median |error| of the p50 "
                f"{'-' if mae is None else f'{mae * 100:.0f} %'} (target <= 25 %; sampling alone, median over the "
                f"cells: {'-' if floor is None else f'{floor * 100:.0f} %'})"
            )
    return out
